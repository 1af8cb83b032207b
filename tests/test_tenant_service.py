"""Tenants through the live service: each tenant's keys, geometry, leases, quotas and bytes are
its own through every actor method, and the service's own calls need the service secret.

One Ray node, one storage node; the tenants are made with the operator's calls (the CLI's);
clients are FlatCakeClients bound by secret, and the adversary calls the actors' methods
directly, as any Ray job can.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import (
    AccessDeniedError,
    QuotaExceededError,
    ReadRangeError,
    TenantError,
)
from tests.conftest import LAYERS, PAGE_BYTES, SMALL_SERVICE

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

NAMESPACE = "fc-tenants"
DRAM = PutHints(turn=2, prior_reply_tokens=1)
SSD = PutHints(turn=1)


def kv(layers: int, pages: int, page_bytes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (layers, pages, page_bytes), dtype=np.uint8)


def keys(prefix: str, pages: int) -> list[str]:
    return [f"{prefix}/{i}" for i in range(pages)]


@pytest.fixture(scope="module")
def service(ray_service):
    from flatcake_ray.client import tenants
    from flatcake_ray.client.client import FlatCakeClient
    from flatcake_ray.config import ClientConfig

    config = ray_service(
        NAMESPACE,
        **SMALL_SERVICE,
        lease_ttl_s=20.0,
        report_interval_s=0.5,
        ramp_seconds=0.0,
        default_beside_tenants=True,  # the default tenant is one of the tenants here
    ).config
    secrets = {
        "alpha": tenants.add_tenant(
            NAMESPACE,
            "alpha",
            layers=LAYERS,
            page_bytes=PAGE_BYTES,
            quota_dram=1 << 20,
            quota_ssd=2 << 20,
        ),
        # another model: other layers, other page size, on the same service
        "beta": tenants.add_tenant(NAMESPACE, "beta", layers=2, page_bytes=16384),
    }
    clients = {
        name: FlatCakeClient(NAMESPACE, config=ClientConfig(tenant_secret=secret))
        for name, secret in secrets.items()
    }
    clients["default"] = FlatCakeClient(NAMESPACE)
    node = ray.get_actor(clients["default"].nodes.links[1].description.actor_name, NAMESPACE)
    yield {"secrets": secrets, "clients": clients, "node": node, "config": config}
    for client in clients.values():
        client.close()


def raised(ref) -> BaseException:
    """The error a remote call raised, as the typed error the actor raised."""
    with pytest.raises(Exception) as caught:
        ray.get(ref, timeout=30)
    return caught.value


def node_stats(service) -> dict:
    from flatcake_ray.client.deploy import operator_secret

    return ray.get(service["node"].stats.remote(operator_secret(NAMESPACE)), timeout=30)


def test_each_tenant_has_its_own_geometry_and_keys(service):
    alpha, beta, default = (service["clients"][n] for n in ("alpha", "beta", "default"))
    assert (alpha.layers, alpha.page_bytes) == (LAYERS, PAGE_BYTES)
    assert (beta.layers, beta.page_bytes) == (2, 16384)
    names = keys("same-name", 6)  # one key list, three tenants: three different pages
    data = {
        "alpha": kv(LAYERS, 6, PAGE_BYTES, 1),
        "beta": kv(2, 6, 16384, 2),
        "default": kv(LAYERS, 6, PAGE_BYTES, 3),
    }
    for name, client in (("alpha", alpha), ("default", default)):
        assert client.exists(names) == 0
        client.put(names, data[name], hints=DRAM)
    assert beta.exists(names) == 0  # another tenant's identical keys are not its hits
    beta.put(names, data["beta"], hints=SSD)
    for name, client in (("alpha", alpha), ("beta", beta), ("default", default)):
        out = np.zeros_like(data[name])
        assert client.get(names, out) == 6
        assert np.array_equal(out, data[name])
    tenants = node_stats(service)["tenants"]
    assert {"alpha", "beta", "default"} <= set(tenants)


def test_a_wrong_secret_is_refused_and_counted(service):
    from flatcake_ray.client.client import FlatCakeClient
    from flatcake_ray.config import ClientConfig

    before = node_stats(service)["denied_calls"]
    with pytest.raises(AccessDeniedError):
        FlatCakeClient(NAMESPACE, config=ClientConfig(tenant_secret="f" * 64))
    node = service["node"]
    for call in (
        node.lookup.remote("x" * 64, ["k"]),
        node.stats.remote("too-short"),
        node.coordinator_view.remote(service["secrets"]["alpha"]),  # a tenant is not the service
        node.shutdown.remote(None),
        node.arm_failpoints.remote(service["secrets"]["beta"], ""),
    ):
        assert isinstance(raised(call), AccessDeniedError)
    assert node_stats(service)["denied_calls"] >= before + 5
    assert ray.get(node.ping.remote()) == 1  # still up


def test_only_the_service_registers_and_reports(service):
    from flatcake_ray.actors.protocol import COORDINATOR_NAME, NodeUsage

    coordinator = ray.get_actor(COORDINATOR_NAME, NAMESPACE)
    forged = coordinator.register.remote(None, "ray-fake", "fake", None, time.time())
    assert isinstance(raised(forged), AccessDeniedError)
    usage = NodeUsage(1, 1, 0, 0, 0, 0, 0)
    alpha = service["secrets"]["alpha"]
    assert isinstance(raised(coordinator.report.remote(alpha, 1, "x", usage)), AccessDeniedError)
    assert isinstance(
        raised(coordinator.add_tenant.remote(alpha, "evil", 1, 4096)), AccessDeniedError
    )
    assert isinstance(raised(coordinator.drain.remote(alpha, 1)), AccessDeniedError)


def test_a_forged_release_is_refused_counted_and_changes_nothing(service):
    alpha, beta = service["secrets"]["alpha"], service["secrets"]["beta"]
    client = service["clients"]["alpha"]
    names = keys("leased", 4)
    data = kv(LAYERS, 4, PAGE_BYTES, 9)
    client.put(names, data, hints=DRAM)
    node = service["node"]
    reply = ray.get(node.lookup.remote(alpha, names))
    assert reply.hits == 4 and reply.lease_id > 0
    before = node_stats(service)
    assert ray.get(node.release.remote(beta, reply.lease_id)) is False  # another tenant's
    assert ray.get(node.release.remote(None, reply.lease_id)) is False  # the default's
    assert ray.get(node.release.remote(alpha, reply.lease_id ^ 1)) is False  # unknown
    after = node_stats(service)
    assert after["releases_foreign"] == before["releases_foreign"] + 2
    assert after["releases_unknown"] == before["releases_unknown"] + 1
    assert after["leases_held"] == before["leases_held"]  # still held: the owner's is good
    assert ray.get(node.release.remote(alpha, reply.lease_id)) is True
    assert ray.get(node.release.remote(alpha, reply.lease_id)) is False  # once only


def test_bytes_are_served_only_from_the_callers_leases(service):
    alpha, beta = service["secrets"]["alpha"], service["secrets"]["beta"]
    names = keys("ranges", 3)
    service["clients"]["alpha"].put(names, kv(LAYERS, 3, PAGE_BYTES, 11), hints=SSD)
    node = service["node"]
    offsets = np.array([0], dtype=np.int64)
    lengths = np.array([4096], dtype=np.int64)
    # nothing leased: nothing served, for anyone
    for secret in (alpha, beta, None):
        error = raised(node.read_ranges.remote(secret, int(Medium.SSD), offsets, lengths))
        assert isinstance(error, ReadRangeError)
    reply = ray.get(node.lookup.remote(alpha, names))
    part = reply.parts[0]
    assert part.medium is Medium.SSD
    mine = np.array([part.offset], dtype=np.int64)
    got = ray.get(node.read_ranges.remote(alpha, int(Medium.SSD), mine, lengths))
    assert len(got) == 4096
    # the same range under another tenant's secret, a huge range, and a malformed one
    assert isinstance(raised(node.read_ranges.remote(beta, 1, mine, lengths)), ReadRangeError)
    huge = np.array([1 << 30], dtype=np.int64)
    assert isinstance(raised(node.read_ranges.remote(alpha, 1, mine, huge)), ReadRangeError)
    assert isinstance(raised(node.ship.remote(alpha, "0", lengths)), ReadRangeError)
    ray.get(node.release.remote(alpha, reply.lease_id))
    assert isinstance(raised(node.read_ranges.remote(alpha, 1, mine, lengths)), ReadRangeError)
    assert node_stats(service)["ranges_refused"] >= 5


def test_a_tenant_over_quota_reclaims_its_own_scopes_only(service):
    alpha, default = service["clients"]["alpha"], service["clients"]["default"]
    kept = keys("other-tenant", 8)
    default.put(kept, kv(LAYERS, 8, PAGE_BYTES, 20), hints=DRAM, session_id="kept")
    pages = 8  # 256 KiB a session; alpha's DRAM quota is 1 MiB
    for i in range(8):
        alpha.put(keys(f"q{i}", pages), kv(LAYERS, pages, PAGE_BYTES, 30 + i), hints=DRAM)
    stats = node_stats(service)["tenants"]
    assert stats["alpha"]["dram_used"] <= 1 << 20
    assert alpha.exists(keys("q7", pages)) == pages  # the newest stays
    assert alpha.exists(keys("q0", pages)) == 0  # the oldest went
    assert default.exists(kept) == 8  # the other tenant's pages are untouched
    with pytest.raises(QuotaExceededError):  # over both its quotas: fits on no medium
        alpha.put(keys("too-big", 80), kv(LAYERS, 80, PAGE_BYTES, 40), hints=DRAM)
    assert alpha.exists(keys("q7", pages)) == pages  # nothing evicted by the refused put


def test_stats_show_a_tenant_only_its_own_use(service):
    node = service["node"]
    mine = ray.get(node.stats.remote(service["secrets"]["beta"]))
    assert set(mine["tenants"]) == {"beta"}


def test_a_forged_tenant_table_is_refused(service):
    from flatcake_ray.actors.auth import KV_NAMESPACE, encode_table
    from flatcake_ray.client import tenants
    from flatcake_ray.core.tenants import Tenant, secret_hash

    forged_secret = "e" * 64
    forged = {"evil": Tenant("evil", secret_hash(forged_secret), LAYERS, PAGE_BYTES)}
    from ray.experimental import internal_kv

    key = f"{NAMESPACE}/tenants".encode()
    good = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
    # any Ray job can write the GCS, but not sign with the service's secret
    internal_kv._internal_kv_put(
        key, encode_table(forged, "w" * 64), overwrite=True, namespace=KV_NAMESPACE
    )
    try:
        deadline = time.monotonic() + 10  # the node's next report re-reads the table
        while node_stats(service)["tables_refused"] == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert node_stats(service)["tables_refused"] >= 1
        error = raised(service["node"].lookup.remote(forged_secret, ["k"]))
        assert isinstance(error, AccessDeniedError)
    finally:
        internal_kv._internal_kv_put(key, good, overwrite=True, namespace=KV_NAMESPACE)
    assert [t["name"] for t in tenants.list_tenants(NAMESPACE)] == ["alpha", "beta"]
    assert "secret_sha256" not in tenants.list_tenants(NAMESPACE)[0]


def test_removing_a_tenant_refuses_it_and_frees_its_pages(service):
    from flatcake_ray.client import tenants

    secret = tenants.add_tenant(NAMESPACE, "gamma", layers=LAYERS, page_bytes=PAGE_BYTES)
    node = service["node"]
    names = keys("gamma", 4)
    from flatcake_ray.client.client import FlatCakeClient
    from flatcake_ray.config import ClientConfig

    with FlatCakeClient(NAMESPACE, config=ClientConfig(tenant_secret=secret)) as gamma:
        gamma.put(names, kv(LAYERS, 4, PAGE_BYTES, 50), hints=SSD)
        assert "gamma" in node_stats(service)["tenants"]
        with pytest.raises(TenantError, match="exists"):
            tenants.add_tenant(NAMESPACE, "gamma", layers=1, page_bytes=4096)
        tenants.remove_tenant(NAMESPACE, "gamma")
        assert isinstance(raised(node.exists.remote(secret, names)), AccessDeniedError)
        deadline = time.monotonic() + 10
        while "gamma" in node_stats(service)["tenants"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "gamma" not in node_stats(service)["tenants"]
    with pytest.raises(TenantError, match="no tenant 'gamma'"):
        tenants.remove_tenant(NAMESPACE, "gamma")


def _channel(service, secret):
    """A direct call channel opened the way a client opens one (``client/direct.py``)."""
    from flatcake_ray.media.call_frames import CallListener

    with CallListener() as listener:
        pid = ray.get(service["node"].open_calls.remote(secret, listener.name), timeout=30)
        return listener.accept_from(pid, 30)


def _ask(channel, method, *args):
    from flatcake_ray.media.call_frames import pack_call, recv_frame, send_frame, unpack_reply

    send_frame(channel, pack_call(method, args))
    return unpack_reply(recv_frame(channel))


def test_direct_calls_act_for_the_tenant_that_opened_them(service):
    from flatcake_ray.core.keys import request_digests

    alpha, secrets = service["clients"]["alpha"], service["secrets"]
    names, data = keys("direct", 5), kv(LAYERS, 5, PAGE_BYTES, 60)
    before = alpha.stats(nodes=False)["client"]["direct_calls"]
    alpha.put(names, data, hints=DRAM)  # its opening and commit over the channel
    assert alpha.stats(nodes=False)["client"]["direct_calls"] >= before + 2
    out = np.zeros_like(data)
    report = alpha.restore_report(names, out)  # on the node's machine: lookup and release
    assert report.pages == 5 and np.array_equal(out, data)
    assert report.direct_calls == 2 and alpha.stats(nodes=False)["client"]["direct_calls"] >= 2
    digests = request_digests(names, None)
    with _channel(service, secrets["beta"]) as beta:
        assert _ask(beta, "exists", digests) == 0  # alpha's pages are not beta's
        with _channel(service, secrets["alpha"]) as mine:
            assert _ask(mine, "exists", digests) == 5
            reply = _ask(mine, "lookup", digests)
            assert reply.hits == 5
            assert _ask(beta, "release", reply.lease_id, []) is False  # not beta's lease
            assert _ask(mine, "release", reply.lease_id, []) is True
    assert node_stats(service)["direct_calls"] >= 7


def test_a_checked_restores_release_is_posted_and_has_run_before_the_next_put(service):
    """On the node's machine a checked restore (``verify_dram``) sends its release over the
    call channel and reads no answer; the node has run every such release before the
    client's next put or stats (``DirectCalls.settle``), and the channel serves on."""
    alpha = service["clients"]["alpha"]
    names, data = keys("posted", 4), kv(LAYERS, 4, PAGE_BYTES, 62)
    alpha.put(names, data, hints=DRAM)
    before = node_stats(service)
    unawaited = alpha.stats(nodes=False)["client"]["releases_unawaited"]
    out = np.zeros_like(data)
    for _ in range(3):
        report = alpha.restore_report(names, out)
        assert report.pages == 4 and report.direct_calls == 2 and np.array_equal(out, data)
    assert alpha.stats(nodes=False)["client"]["releases_unawaited"] == unawaited + 3
    alpha.put(keys("posted-next", 2), data[:, :2], hints=DRAM)  # settles the posted releases
    after = node_stats(service)
    assert after["releases"] - before["releases"] == 3
    assert after["leases_held"] == 0 and after["releases_unknown"] == before["releases_unknown"]
    assert alpha.get(names, out) == 4 and np.array_equal(out, data)


def test_a_channel_carries_a_requests_calls_only_and_garbage_ends_it(service):
    from flatcake_ray.errors import ChannelClosedError, InvalidKeyError, ShapeError
    from flatcake_ray.media.call_frames import CallListener, recv_frame, send_frame

    secret, node = service["secrets"]["alpha"], service["node"]
    with _channel(service, secret) as channel:
        for method in ("land", "abort_put", "shutdown", "stats", "open_calls", "hand_chunks"):
            with pytest.raises(ShapeError, match="not a direct call"):
                _ask(channel, method, "x")
        with pytest.raises(InvalidKeyError):  # the node's own checks, typed as over Ray
            _ask(channel, "lookup", "not keys")
        send_frame(channel, b"\xc1 is no msgpack")
        with pytest.raises(ChannelClosedError):  # the node hung up
            recv_frame(channel)
    with _channel(service, secret) as channel:
        channel.sendall((1 << 31).to_bytes(4, "big"))  # a frame past any call
        with pytest.raises(ChannelClosedError):
            recv_frame(channel)
    with CallListener() as listener:
        refused = raised(node.open_calls.remote("x" * 64, listener.name))
        assert isinstance(refused, AccessDeniedError)
    alpha = service["clients"]["alpha"]
    names, data = keys("after-garbage", 3), kv(LAYERS, 3, PAGE_BYTES, 61)
    alpha.put(names, data, hints=DRAM)
    out = np.zeros_like(data)
    assert alpha.get(names, out) == 3 and np.array_equal(out, data)  # the node serves on


def test_a_removed_tenants_open_channel_is_refused(service):
    from flatcake_ray.client import tenants

    secret = tenants.add_tenant(NAMESPACE, "delta", layers=LAYERS, page_bytes=PAGE_BYTES)
    names = keys("delta", 2)
    with _channel(service, secret) as channel:
        from flatcake_ray.core.keys import request_digests

        assert _ask(channel, "exists", request_digests(names, None)) == 0
        tenants.remove_tenant(NAMESPACE, "delta")
        with pytest.raises(AccessDeniedError):
            _ask(channel, "exists", request_digests(names, None))


def test_a_tenant_opens_a_bounded_number_of_channels(service):
    """Each channel is a thread on the node: a tenant gets ``CHANNELS_PER_TENANT`` of them
    (``TenantLimitError`` past it, nothing else changed); a closed one frees its place."""
    from flatcake_ray.actors.call_channels import CHANNELS_PER_TENANT
    from flatcake_ray.client import tenants
    from flatcake_ray.errors import TenantLimitError
    from flatcake_ray.media.call_frames import CallListener

    secret = tenants.add_tenant(NAMESPACE, "epsilon", layers=LAYERS, page_bytes=PAGE_BYTES)
    channels = [_channel(service, secret) for _ in range(CHANNELS_PER_TENANT)]
    try:
        with CallListener() as listener:
            refused = raised(service["node"].open_calls.remote(secret, listener.name))
        assert isinstance(refused, TenantLimitError)
        assert _ask(channels[-1], "exists", ["k"]) == 0  # the open ones still serve
        channels.pop().close()
        deadline = time.monotonic() + 10
        while True:  # the node sees the close when its thread reads the end of the stream
            try:
                channels.append(_channel(service, secret))
                break
            except TenantLimitError:
                assert time.monotonic() < deadline, "a closed channel's place never freed"
                time.sleep(0.1)
    finally:
        for channel in channels:
            channel.close()
        tenants.remove_tenant(NAMESPACE, "epsilon")
