"""The Ray service for real: a head plus two storage nodes on 127.0.0.1 (ray Cluster).

Clients "on node A/B" are Ray actors pinned to that node, so node detection goes by Ray node
id and a reader on B really takes the remote path for A's pages (all nodes share this
machine's /dev/shm and disk). One cluster per module: the data path is here; operating the
service (CLI, coordinator restart, drain, node removal) is in ``test_service_operations.py``
and its parts without Ray in ``test_service_units.py``.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter

import numpy as np
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

from ray import cloudpickle  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from flatcake_ray.actors.protocol import node_actor_name  # noqa: E402
from flatcake_ray.client import deploy as service  # noqa: E402
from flatcake_ray.client.client import FlatCakeClient  # noqa: E402
from flatcake_ray.client.source import digests_of  # noqa: E402
from flatcake_ray.config import ClientConfig  # noqa: E402
from flatcake_ray.core.catalog import PutHints  # noqa: E402
from flatcake_ray.core.gva import decode  # noqa: E402
from flatcake_ray.core.keys import PageKey  # noqa: E402
from flatcake_ray.errors import InvalidKeyError, ShapeError  # noqa: E402
from flatcake_ray.transports.base import (  # noqa: E402
    LOCAL_DRAM,
    LOCAL_SSD,
    OBJECT_STORE_FALLBACK,
    REMOTE_DRAM_NIXL,
    REMOTE_SSD_SHIPPED,
)
from flatcake_ray.transports.routing import route  # noqa: E402
from tests.conftest import QUICK_NODE_DEATH, wait_for  # noqa: E402

SERVICE_SECRET = "s" * 32

# Workers cannot import this file by name; ship its classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NAMESPACE = "fc-test"
LAYERS = 4
PAGE_BYTES = 8192
DRAM = PutHints(turn=2, prior_reply_tokens=1)  # short chat -> DRAM
SSD = PutHints(turn=1)  # one-shot -> SSD


def kv_for(pages: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (LAYERS, pages, PAGE_BYTES), dtype=np.uint8)


def keys_for(name: str, pages: int) -> list[str]:
    return [f"{name}/{i}" for i in range(pages)]


class ClientOnNode:
    """A FlatCakeClient living on one Ray node (pinned)."""

    def __init__(self, namespace: str) -> None:
        self.client = FlatCakeClient(namespace)
        self.client.warm_up()

    def local_node_id(self) -> int:
        return self.client.nodes.local_node_id

    def put(self, name: str, pages: int, seed: int, hints: PutHints, session: str | None = None):
        keys = keys_for(name, pages)
        return self.client.put(keys, kv_for(pages, seed), session_id=session or name, hints=hints)

    def put_keys(self, keys: list[str], kv: np.ndarray, session: str, hints: PutHints, parent=None):
        return self.client.put(keys, kv, session_id=session, hints=hints, parent=parent)

    def restore(self, name: str, pages: int, seed: int | None = None, allow=None):
        client = self.client if allow is None else FlatCakeClient(NAMESPACE, allow=allow)
        out = np.zeros((LAYERS, pages, PAGE_BYTES), dtype=np.uint8)
        report = client.restore_report(keys_for(name, pages), out)
        exact = None if seed is None else bool(np.array_equal(out, kv_for(pages, seed)))
        if client is not self.client:
            client.close()
        return report, exact, out[:, : report.pages].copy()


def pinned_client(node) -> object:
    strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
    return ray.remote(ClientOnNode).options(num_cpus=0, scheduling_strategy=strategy)


def two_node_deployment(ray_service):
    """The service on a head and two storage nodes, a client pinned to each node and one on
    the driver (a module-scoped fixture of each module that uses it)."""
    started = ray_service(
        NAMESPACE,
        workers=2,
        worker_args={"resources": {"fc": 1}},
        system=QUICK_NODE_DEATH,
        resource="fc",
        layers=LAYERS,
        page_bytes=PAGE_BYTES,
        dram_bytes=16 << 20,
        dram_chunks=2,  # chunks of 8 MiB: a DRAM segment fits one (the 3.3 MB puts below)
        ssd_file_bytes=16 << 20,
        ship_bytes=8 << 20,
        landing_bytes=8 << 20,  # SSD puts over 32 pages land two slots at a time
        rpc_timeout_s=8.0,
        node_down_s=2.0,
        report_interval_s=0.5,
        node_timeout_s=3.0,
        ramp_seconds=0.0,
    )
    nodes = started.workers
    clients = [pinned_client(node).remote(NAMESPACE) for node in nodes]
    driver = FlatCakeClient(NAMESPACE)  # on the head, which has no storage node
    driver.warm_up()
    ids = ray.get([c.local_node_id.remote() for c in clients])
    yield {
        "driver": driver,
        "cluster": started.cluster,
        "config": started.config,
        "nodes": nodes,
        "by_node_id": dict(zip(ids, clients, strict=True)),
        "ray_node_of": dict(zip(ids, (n.node_id for n in nodes), strict=True)),
    }
    driver.close()


@pytest.fixture(scope="module")
def deployment(ray_service):
    yield from two_node_deployment(ray_service)


def other(deployment, node_id: int):
    return next(c for n, c in deployment["by_node_id"].items() if n != node_id)


def owner_of(deployment, name: str, pages: int) -> int:
    return decode(int(deployment["driver"].gvas(keys_for(name, pages))[0])).node_id


# ---- the service ----------------------------------------------------------------------------
def test_every_node_registered_with_its_own_node_id(deployment):
    info = service.status(NAMESPACE)
    assert sorted(row["node_id"] for row in info["nodes"]) == sorted(deployment["by_node_id"])
    assert info["coordinator"]["nodes"] == 2
    assert "coordinator" in service.format_status(info)


@pytest.mark.parametrize(
    ("medium", "hints", "local_path", "remote_path"),
    [("DRAM", DRAM, LOCAL_DRAM, REMOTE_DRAM_NIXL), ("SSD", SSD, LOCAL_SSD, REMOTE_SSD_SHIPPED)],
)
def test_written_on_one_node_restored_on_the_other(
    deployment, medium, hints, local_path, remote_path
):
    writer = next(iter(deployment["by_node_id"].values()))
    name, pages, seed = f"cross-{medium}", 40, hash(medium) % 1000
    result = ray.get(writer.put.remote(name, pages, seed, hints))
    assert (result.pages_written, result.medium.name) == (pages, medium)
    owner = owner_of(deployment, name, pages)
    local, exact_local, _ = ray.get(
        deployment["by_node_id"][owner].restore.remote(name, pages, seed)
    )
    remote, exact_remote, _ = ray.get(other(deployment, owner).restore.remote(name, pages, seed))
    assert exact_local and exact_remote
    assert list(local.paths) == [local_path] and list(remote.paths) == [remote_path]
    assert local.pages == remote.pages == pages
    # A lookup per node asked (the chain's home, then the owner it names: this reader never
    # saw the session), one `home_of`, a release, and for shipped SSD one ship and one unship
    # per window: never per page.
    assert remote.nodes_asked <= 2 and remote.actor_calls <= remote.nodes_asked + 4


# What loads torch in a storage node's store: the restore pipeline and its destinations.
TORCH_MODULES = (
    "flatcake_ray.restore.pipeline",
    "flatcake_ray.restore.dest",
    "flatcake_ray.cuda_ext.scatter",
)


def test_a_storage_node_serves_every_path_without_its_restore_pipeline(deployment):
    """A node's store loads its restore pipeline (and torch with it) only to re-check a scope
    a reader found bad (``node/store_restores.py``): a node that served puts and local and
    remote restores on both media has not loaded it. (``torch`` itself may be there: NIXL's
    package imports it to probe CUDA where torch is a CPU build, as here.)"""
    writer = next(iter(deployment["by_node_id"].values()))
    for medium, hints in (("DRAM", DRAM), ("SSD", SSD)):
        name = f"torchless-{medium}"
        ray.get(writer.put.remote(name, 40, 5, hints))
        owner = owner_of(deployment, name, 40)
        for reader in (deployment["by_node_id"][owner], other(deployment, owner)):
            assert ray.get(reader.restore.remote(name, 40, 5))[1]
    for ray_node_id in deployment["ray_node_of"].values():
        node = ray.get_actor(node_actor_name(ray_node_id), NAMESPACE)
        loaded = ray.get(
            node.__ray_call__.remote(lambda _: [*filter(sys.modules.get, TORCH_MODULES)])
        )
        assert loaded == []


def _put_counters(client) -> Counter:
    total: Counter = Counter()
    for node in client.stats()["nodes"].values():
        total.update(
            {k: v for k, v in node.items() if k.startswith(("puts_", "ssd_write", "layers"))}
        )
    return total


@pytest.mark.parametrize(("medium", "hints"), [("DRAM", DRAM), ("SSD", SSD)])
def test_puts_write_into_memory_the_owner_hands_out(deployment, medium, hints):
    """Writers on the owner's node and off it (the driver: NIXL WRITE) put straight into the
    arena (DRAM) or the owner's landing slots (SSD, two at a time for a big put), nothing in
    the call; every reader gets the exact bytes; the owner counts the memory each put used."""
    driver = deployment["driver"]
    writer = next(iter(deployment["by_node_id"].values()))
    before = _put_counters(driver)
    name, pages = f"land-{medium}", 100  # 3.3 MB: DRAM has room; SSD takes two slots
    driver.put(keys_for(name, pages), kv_for(pages, 11), session_id=name, hints=hints)
    ray.get(writer.put.remote(f"{name}-w", pages, 12, hints))
    for stored, seed in ((name, 11), (f"{name}-w", 12)):
        for reader in deployment["by_node_id"].values():
            report, exact, _ = ray.get(reader.restore.remote(stored, pages, seed))
            assert exact and report.pages == pages
    moved = _put_counters(driver) - before
    memory = "arena" if medium == "DRAM" else "landing"
    assert moved[f"puts_{memory}"] == 2 and moved["puts_inline"] == 0, moved
    assert moved["layers_landed"] == 2 * LAYERS
    if medium == "SSD":  # each layer one O_DIRECT write, straight from its slot
        assert moved["ssd_write_commands"] == 2 * LAYERS


def test_a_put_over_ray_continues_its_parents_session(deployment):
    """A put sends its keys and parent packed (hashed by the client): one that names a stored
    key as its parent and no session joins the parent's session, keys given as ``PageKey``
    in the client's namespace hash as its plain keys do, and a key the client cannot hash is
    refused before any call, with nothing stored."""
    driver = deployment["driver"]
    first = keys_for("parent-a", 8)
    opened = driver.put(first, kv_for(8, 31), namespace="chat", session_id="chat-p", hints=DRAM)
    assert opened.session_id == "chat-p"
    # The parent, a plain key, is in the namespace its put's keys name.
    more = [PageKey("chat", key) for key in keys_for("parent-b", 8)]
    result = driver.put(more, kv_for(8, 32), parent=first[-1], hints=DRAM)
    assert (result.pages_written, result.session_id) == (8, "chat-p")
    assert driver.exists(keys_for("parent-b", 8), namespace="chat") == 8
    with pytest.raises(InvalidKeyError):
        driver.put([*keys_for("parent-c", 3), True], kv_for(4, 33), session_id="chat-q")
    assert driver.exists(keys_for("parent-c", 3)) == 0


def test_a_cold_lookup_asks_the_chains_home_not_every_node(deployment):
    """A client that never saw a chain finds it through the chain's home (derived from the
    first digest, told by the writer): no fan-out to every node, at most three calls."""
    writers = list(deployment["by_node_id"].values())
    for i in range(6):  # chains on both nodes (each writer's stay local), homes on both
        ray.get(writers[i % 2].put.remote(f"home{i}", 8, 40 + i, DRAM))
    reader = FlatCakeClient(NAMESPACE)
    try:
        for i in range(6):
            reader.forget_locations()
            report = reader.locate(keys_for(f"home{i}", 8))
            assert report.pages == 8 and report.actor_calls <= 3
        assert reader.stats(nodes=False)["client"]["fanouts"] == 0
    finally:
        reader.close()


def test_a_warm_locate_with_lease_is_one_call_and_lets_its_lease_go(deployment):
    """``locate(lease=True)`` with the owner known is one ``lookup``: the lease it let go of
    rides on the next lookup to that node (the last one goes alone, shortly after), and the
    node ends up holding none of them, every release a lease it knew."""
    writer = next(iter(deployment["by_node_id"].values()))
    ray.get(writer.put.remote("onecall", 8, 7, DRAM))
    with FlatCakeClient(NAMESPACE) as reader:
        owner = reader.locate(keys_for("onecall", 8)).node_id
        before = reader.stats()["nodes"][owner]
        reports = [reader.locate(keys_for("onecall", 8), lease=True) for _ in range(6)]
        assert all(r.pages == 8 and r.node_id == owner for r in reports)
        assert [r.actor_calls for r in reports[1:]] == [1] * 5
        after = wait_for(
            "the last lease let go of",
            lambda: (s := reader.stats()["nodes"][owner])["leases_held"] == 0 and s,
        )
        assert after["releases"] - before["releases"] == 6
        assert after["lease_misses"] == before["lease_misses"]
        # At least the last went alone; the rest rode on lookups (how many went alone
        # depends on how quickly the next lookup came).
        assert 1 <= reader.stats(nodes=False)["client"]["release_calls"] <= 6
        link = reader.nodes.require(owner)
        digests = digests_of(keys_for("onecall", 8), None)
        with pytest.raises(ShapeError):  # releases that are not lease ids: refused
            ray.get(link.handle.lookup.remote(digests, None, "lease ids"), timeout=60)


def test_a_client_off_the_owners_machine_asks_it_over_a_tcp_channel(deployment):
    """The driver's node has no storage node: its lookups, releases and puts to the owner go
    over a TCP call channel the owner opened to it (``remote_direct_calls``, on by default),
    the same answers as over Ray; turned off, every call goes over Ray."""
    writer = next(iter(deployment["by_node_id"].values()))
    ray.get(writer.put.remote("tcp-calls", 8, 5, DRAM))
    keys = keys_for("tcp-calls", 8)
    owner = owner_of(deployment, "tcp-calls", 8)
    for remote_direct in (True, False):
        config = ClientConfig(remote_direct_calls=remote_direct)
        channels = deployment["driver"].stats()["nodes"][owner]["call_channels"]
        with FlatCakeClient(NAMESPACE, config=config) as reader:
            assert reader.locate(keys).node_id == owner
            assert not reader.nodes.require(owner).local
            reports = [reader.locate(keys, lease=True) for _ in range(3)]
            out = np.zeros((LAYERS, 8, PAGE_BYTES), dtype=np.uint8)
            restored = reader.restore_report(keys, out)
            assert restored.pages == 8 and np.array_equal(out, kv_for(8, 5))
            new_keys = keys_for(f"tcp-put-{remote_direct}", 4)
            assert reader.put(new_keys, kv_for(4, 6), hints=DRAM).pages_written == 4
            assert all(r.pages == 8 and r.actor_calls == 1 for r in reports)
            direct = [r.direct_calls for r in (*reports, restored)]
            assert direct == ([1, 1, 1, 2] if remote_direct else [0, 0, 0, 0])
            assert (reader.stats(nodes=False)["client"]["direct_calls"] > 0) == remote_direct
            if remote_direct:
                assert reader.stats()["nodes"][owner]["call_channels"] > channels


def test_a_checked_restore_waits_for_no_release_and_its_lease_still_goes_back(deployment):
    """Where readers check every block (``verify_dram``, the service's default), a restore's
    pages count once checked: its release is sent and not waited for. The node still lets
    go of every lease, every release one it knew, and the client's stats (as its puts) are
    asked once its releases have run."""
    writer = next(iter(deployment["by_node_id"].values()))
    ray.get(writer.put.remote("checked", 8, 9, DRAM))
    with FlatCakeClient(NAMESPACE) as reader:
        owner = reader.locate(keys_for("checked", 8)).node_id
        assert reader.nodes.require(owner).description.verify_dram
        before = reader.stats()["nodes"][owner]
        unawaited = reader.stats(nodes=False)["client"]["releases_unawaited"]
        for _ in range(4):
            out = np.zeros((LAYERS, 8, PAGE_BYTES), dtype=np.uint8)
            assert reader.restore_report(keys_for("checked", 8), out).pages == 8
            assert np.array_equal(out, kv_for(8, 9))
        assert reader.stats(nodes=False)["client"]["releases_unawaited"] == unawaited + 4
        after = reader.stats()["nodes"][owner]  # asked once the releases ran: none held
        assert after["leases_held"] == 0
        assert after["releases"] - before["releases"] == 4
        assert after["lease_misses"] == before["lease_misses"]


def test_routing_follows_the_gva_bits(deployment):
    writer = next(iter(deployment["by_node_id"].values()))
    ray.get(writer.put.remote("route", 8, 3, DRAM))
    with FlatCakeClient(NAMESPACE) as client:
        gvas = client.gvas(keys_for("route", 8))
    medium, owner, _ = decode(int(gvas[0]))
    assert len(gvas) == 8 and medium.name == "DRAM"
    for reader_id, reader in deployment["by_node_id"].items():
        expected = route(int(gvas[0]), reader_id, frozenset({REMOTE_DRAM_NIXL}))
        assert expected == (LOCAL_DRAM if reader_id == owner else REMOTE_DRAM_NIXL)
        report, exact, _ = ray.get(reader.restore.remote("route", 8, 3))
        assert exact and list(report.paths) == [expected]
    # With no remote path allowed the labelled object-store fallback still serves exact bytes.
    report, exact, _ = ray.get(other(deployment, owner).restore.remote("route", 8, 3, allow=()))
    assert exact and list(report.paths) == [OBJECT_STORE_FALLBACK]


def test_concurrent_writers_to_one_scope_are_write_once(deployment):
    a, b = deployment["by_node_id"].values()
    refs = [w.put.remote("shared", 30, seed, SSD, "shared") for w, seed in ((a, 11), (b, 12))]
    results = ray.get(refs)
    assert sum(r.pages_written for r in results) == 30
    report, _, got = ray.get(a.restore.remote("shared", 30))
    assert report.pages == 30
    assert any(np.array_equal(got, kv_for(30, seed)) for seed in (11, 12))
    again = ray.get(b.put.remote("shared", 30, 13, SSD, "shared"))
    assert (again.pages_written, again.pages_skipped) == (0, 30)
    _, _, after = ray.get(b.restore.remote("shared", 30))
    assert np.array_equal(after, got)


def test_overlapping_concurrent_puts_stay_consistent(deployment):
    first = [f"ov/{i}" for i in range(20)]
    second = [f"ov/{i}" for i in range(10, 30)]
    data = {11: kv_for(20, 21), 12: kv_for(20, 22)}

    a, b = deployment["by_node_id"].values()
    ray.get(
        [
            a.put_keys.remote(first, data[11], "ov", DRAM),
            b.put_keys.remote(second, data[12], "ov", DRAM),
        ]
    )
    with FlatCakeClient(NAMESPACE) as client:
        out = np.zeros((LAYERS, 30, PAGE_BYTES), dtype=np.uint8)
        assert client.get(first[:10] + second, out) == 30
    assert np.array_equal(out[:, :10], data[11][:, :10])
    assert np.array_equal(out[:, 20:], data[12][:, 10:])
    overlap = out[:, 10:20]
    assert np.array_equal(overlap, data[11][:, 10:]) or np.array_equal(overlap, data[12][:, :10])


def test_client_validates_locally_and_fills_numpy_and_torch(deployment):
    torch = pytest.importorskip("torch")
    with FlatCakeClient(NAMESPACE) as client:
        kv = kv_for(6, 5)
        with pytest.raises(ShapeError):
            client.put([], kv)
        with pytest.raises(InvalidKeyError):
            client.put([1.5] * 6, kv)
        with pytest.raises(ShapeError):
            client.put(keys_for("val", 5), kv)
        with pytest.raises(ShapeError):
            client.get(keys_for("val", 6), np.zeros((LAYERS, 2, PAGE_BYTES), np.uint8))
        assert client.put(keys_for("val", 6), kv, session_id="val", hints=DRAM).pages_written == 6
        assert client.exists([*keys_for("val", 6), "absent"]) == 6
        tensor = torch.zeros((LAYERS, 6, PAGE_BYTES // 2), dtype=torch.float16)
        assert client.get(keys_for("val", 6), tensor) == 6
        assert np.array_equal(tensor.numpy().view(np.uint8), kv)
        out = np.zeros_like(kv)
        assert asyncio.run(client.aget(keys_for("val", 6), out)) == 6
        assert asyncio.run(client.aexists(keys_for("val", 3))) == 3
        assert np.array_equal(out, kv)
        stats = client.stats()
        assert stats["client"]["hit_pages"] >= 12 and REMOTE_DRAM_NIXL in stats["paths"]
        assert sum(n["lookups"] for n in stats["nodes"].values()) >= 2


@pytest.mark.gpu
def test_get_into_a_cuda_tensor(deployment):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    client = deployment["driver"]
    kv = kv_for(5, 77)
    client.put(keys_for("cuda", 5), kv, session_id="cuda", hints=DRAM)
    out = torch.zeros((LAYERS, 5, PAGE_BYTES), dtype=torch.uint8, device="cuda")
    assert client.get(keys_for("cuda", 5), out) == 5
    assert np.array_equal(out.cpu().numpy(), kv)
