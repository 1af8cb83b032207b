"""One contract, both stores: the same assertions for the in-process FlatCakeStore and for the
Ray client (FlatCakeClient) on a local cluster of a head and two nodes, each with a storage
node (so the client on the head reads some prefixes locally and some over NIXL).

What every KVStore promises: round trips on both media; layer-wise puts whose keys appear only
after the last layer landed; a failed or abandoned put publishes nothing and gives its space
back; restores through the one pipeline, layer by layer in order, with FC-MAS admission (a
DRAM-ready restore never waits behind SSD restores) and staging memory that does not grow
with the context.
"""

from __future__ import annotations

import pickle
import time
import uuid

import numpy as np
import pytest
import torch

from flatcake_ray import failpoints
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import LeaseError, RestoreTimeoutError, StoreWriteError
from flatcake_ray.node.store import FlatCakeStore
from flatcake_ray.restore import PagedPool, RestorePipeline
from tests.conftest import LAYERS, PAGE_BYTES, random_kv, small_config
from tests.test_restore import WAIT, GatedScatter, wait_until

pytestmark = pytest.mark.ray

DRAM = PutHints(turn=2, prior_reply_tokens=1)  # short chat
SSD = PutHints(turn=1)  # one-shot
HINTS = {Medium.DRAM: DRAM, Medium.SSD: SSD}
NAMESPACE = "fc-contract-stores"
PUT_TTL_S = 6.0


@pytest.fixture(scope="module")
def ray_client(ray_service):
    pytest.importorskip("ray")
    from flatcake_ray.client.client import FlatCakeClient
    from flatcake_ray.config import ClientConfig

    ray_service(
        NAMESPACE,
        workers=2,
        env={"FLATCAKE_FAILPOINTS_REMOTE": "1"},  # the nodes inherit it: tests arm faults
        layers=LAYERS,
        page_bytes=PAGE_BYTES,
        dram_bytes=16 << 20,
        ssd_file_bytes=16 << 20,
        ship_bytes=4 << 20,
        landing_bytes=1 << 20,  # SSD puts over 128 KiB land two slots at a time
        lease_ttl_s=PUT_TTL_S,
        report_interval_s=0.5,
        ramp_seconds=0.0,
    )
    client = FlatCakeClient(NAMESPACE, config=ClientConfig())
    client.warm_up()
    yield client
    client.close()


@pytest.fixture(params=["in-process", "ray-client"])
def store(request, tmp_path):
    if request.param == "ray-client":
        yield request.getfixturevalue("ray_client")
        return
    local = FlatCakeStore(small_config(tmp_path, dram_bytes=16 << 20, put_ttl_s=PUT_TTL_S))
    yield local
    local.close()


def keys_for(pages: int) -> list[str]:
    """Keys no other test writes (the Ray service is shared by the module)."""
    prefix = uuid.uuid4().hex[:10]
    return [f"{prefix}/{i}" for i in range(pages)]


def node_stats(store) -> list[dict]:
    stats = store.stats()
    return list(stats["nodes"].values()) if "nodes" in stats else [stats]


def arm_where_it_writes(store, spec: str) -> None:
    """Arm failpoints in the process that writes: this one, or every storage node."""
    if isinstance(store, FlatCakeStore):
        failpoints.disarm_all()
        failpoints.arm_from_spec(spec)
        return
    import ray

    from flatcake_ray.client.deploy import operator_secret

    secret = operator_secret(NAMESPACE)  # the service's own call: the operator's secret
    handles = [link.handle.actor for link in store.nodes.up()]
    ray.get([handle.arm_failpoints.remote(secret, spec) for handle in handles])


@pytest.fixture
def faults(store):
    yield lambda spec: arm_where_it_writes(store, spec)
    arm_where_it_writes(store, "")


def used(store, medium: Medium) -> int:
    key = "dram_used" if medium is Medium.DRAM else "ssd_reserved"
    return sum(s[key] for s in node_stats(store))


# ---- round trips and puts -------------------------------------------------------------------


@pytest.mark.parametrize("medium", [Medium.DRAM, Medium.SSD])
def test_round_trip_on_each_medium(store, medium):
    keys, kv = keys_for(12), random_kv(12, seed=1)
    result = store.put(keys, kv, session_id=keys[0], hints=HINTS[medium])
    assert (result.pages_written, result.medium) == (12, medium)
    assert store.exists(keys) == 12 and store.probe(keys).on_ssd == (medium is Medium.SSD)
    out = np.zeros_like(kv)
    assert store.get(keys, out) == 12 and np.array_equal(out, kv)
    halves = torch.zeros((LAYERS, 12, PAGE_BYTES // 2), dtype=torch.float16)
    assert store.get(keys, halves) == 12
    assert np.array_equal(halves.view(torch.uint8).numpy(), kv)
    assert store.put(keys, kv).pages_skipped == 12  # write-once


def test_layer_wise_put_publishes_after_the_last_layer(store):
    keys, kv = keys_for(9), random_kv(9, seed=2)
    with store.begin_put(keys, session_id=keys[0], hints=SSD) as put:
        for layer in range(LAYERS):
            assert store.exists(keys) == 0  # nothing visible before the last layer landed
            put.write_layer(layer, torch.from_numpy(kv[layer]))
        assert store.exists(keys) == 0
        result = put.commit()
    assert result.pages_written == 9 and store.exists(keys) == 9
    out = np.zeros_like(kv)
    assert store.get(keys, out) == 9 and np.array_equal(out, kv)


def test_an_unfinished_put_publishes_nothing_and_gives_its_space_back(store):
    keys, kv = keys_for(16), random_kv(16, seed=3)
    before = used(store, Medium.DRAM)
    put = store.begin_put(keys, session_id=keys[0], hints=DRAM)
    put.write_layer(0, kv[0])
    with pytest.raises(StoreWriteError, match="before layers"):
        put.commit()  # layers 1.. were never written
    assert store.exists(keys) == 0
    deadline = time.monotonic() + WAIT
    while used(store, Medium.DRAM) != before and time.monotonic() < deadline:
        time.sleep(0.05)  # the Ray client's abort reaches its owner asynchronously
    assert used(store, Medium.DRAM) == before


def settle(store, medium: Medium, expected: int) -> None:
    """Wait until ``medium`` is back to ``expected`` used bytes (a client's abort reaches its
    owner asynchronously)."""
    deadline = time.monotonic() + WAIT
    while used(store, medium) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert used(store, medium) == expected


def test_a_failed_layer_write_publishes_nothing_and_gives_its_space_back(store, faults):
    keys, kv = keys_for(16), random_kv(16, seed=10)
    before = used(store, Medium.SSD)
    refused = [s.get("aborts_refused", 0) for s in node_stats(store)]
    faults("store.write_layer=oserror*1@2")  # the third layer's write fails on the owner
    with (
        pytest.raises(StoreWriteError),
        store.begin_put(keys, session_id=keys[0], hints=SSD) as put,
    ):
        for layer in range(LAYERS):
            put.write_layer(layer, kv[layer])
        put.commit()
    assert store.exists(keys) == 0
    settle(store, Medium.SSD, before)
    faults("")
    assert store.put(keys, kv, session_id=keys[0], hints=SSD).pages_written == 16  # retried
    # The owner ended the put itself: the client sent it no abort to refuse.
    assert refused == [s.get("aborts_refused", 0) for s in node_stats(store)]


def test_a_failed_publish_leaves_no_key_and_no_record(store, faults):
    keys, kv = keys_for(16), random_kv(16, seed=11)
    before = used(store, Medium.SSD)
    faults("store.publish=oserror*1")  # after the manifest record, before the keys
    with pytest.raises(StoreWriteError):
        store.put(keys, kv, session_id=keys[0], hints=SSD)
    assert store.exists(keys) == 0
    settle(store, Medium.SSD, before)
    if isinstance(store, FlatCakeStore):  # a restart must not bring the segment back
        config = store.config
        store.close()
        with FlatCakeStore(config) as reopened:
            assert reopened.exists(keys) == 0 and reopened.stats()["segments"] == 0


def test_an_abandoned_put_expires_and_gives_its_space_back(store):
    keys, kv = keys_for(16), random_kv(16, seed=4)
    before = used(store, Medium.SSD)
    put = store.begin_put(keys, session_id=keys[0], hints=SSD)
    put.write_layer(0, kv[0])  # then the writer goes away: no commit, no abort
    assert sum(s["puts_open"] for s in node_stats(store)) >= 1
    time.sleep(PUT_TTL_S + 1.5)
    probe = np.zeros((LAYERS, 1, PAGE_BYTES), dtype=np.uint8)
    store.get(keys_for(1), probe)  # an in-process store expires puts on its next lease
    assert sum(s["puts_open"] for s in node_stats(store)) == 0
    assert sum(s["puts_expired"] for s in node_stats(store)) >= 1
    assert store.exists(keys) == 0 and used(store, Medium.SSD) == before
    with pytest.raises(StoreWriteError):  # its owner let go of it: it can never complete
        for layer in range(1, LAYERS):
            put.write_layer(layer, kv[layer])
        put.commit()


# ---- restores through the one pipeline ------------------------------------------------------


def one_layer_pipeline(store, pages: int, **options) -> RestorePipeline:
    """A pipeline over the store's own source whose slot holds one layer of ``pages``."""
    slot = -(-(pages * PAGE_BYTES) // 4096) * 4096 + 4096
    return RestorePipeline(store.source, slot_bytes=slot, **options)


@pytest.mark.parametrize("medium", [Medium.DRAM, Medium.SSD])
def test_restore_waits_layer_by_layer_in_order(store, medium):
    keys, kv = keys_for(8), random_kv(8, seed=5)
    store.put(keys, kv, session_id=keys[0], hints=HINTS[medium])
    recorder = GatedScatter()
    pool = torch.zeros((LAYERS, 32, PAGE_BYTES), dtype=torch.uint8)
    slots = np.random.default_rng(5).permutation(32)[:8]
    with one_layer_pipeline(store, 8, scatter=recorder) as pipeline:
        gates = [recorder.gate(pool, layer) for layer in range(LAYERS)]
        handle = pipeline.submit(keys, PagedPool(pool, slots))
        for layer in range(LAYERS):
            with pytest.raises(RestoreTimeoutError):
                handle.wait_for_layer(layer, timeout=0.05)  # held at its scatter
            gates[layer].set()
            assert handle.wait_for_layer(layer, WAIT) == 8
            assert np.array_equal(pool[layer, slots].numpy(), kv[layer])
        assert handle.wait(WAIT) == 8
    assert [layer for _, layer in recorder.calls] == list(range(LAYERS))


def test_a_dram_ready_restore_never_waits_behind_ssd_restores(store):
    ssd_keys, dram_keys = keys_for(8), keys_for(8)
    store.put(ssd_keys, random_kv(8, seed=6), session_id=ssd_keys[0], hints=SSD)
    dram_kv = random_kv(8, seed=7)
    store.put(dram_keys, dram_kv, session_id=dram_keys[0], hints=DRAM)
    recorder = GatedScatter()
    with one_layer_pipeline(store, 8, windows=1, scatter=recorder) as pipeline:
        held = torch.zeros((LAYERS, 8, PAGE_BYTES), dtype=torch.uint8)
        gate = recorder.gate(held, 0)
        slow = pipeline.submit(ssd_keys, held, np.arange(8))  # holds the only SSD window
        queued = pipeline.submit(ssd_keys, torch.zeros_like(held), np.arange(8))
        assert recorder.entered.wait(WAIT)
        out = np.zeros((LAYERS, 8, PAGE_BYTES), dtype=np.uint8)
        fast = pipeline.submit(dram_keys, out, np.arange(8))
        assert fast.wait(WAIT) == 8 and np.array_equal(out, dram_kv)
        assert not slow.done and not queued.done  # the SSD restores still wait, not revoked
        gate.set()
        assert slow.wait(WAIT) == 8 and queued.wait(WAIT) == 8
        assert pipeline.scheduler.stats().cancelled == 0


def test_staging_memory_does_not_grow_with_the_context(store):
    short_keys, long_keys = keys_for(2), keys_for(120)
    long_kv = random_kv(120, seed=8)
    store.put(short_keys, random_kv(2, seed=9), session_id=short_keys[0], hints=SSD)
    store.put(long_keys, long_kv, session_id=long_keys[0], hints=SSD)
    with RestorePipeline(store.source, slot_bytes=4 * PAGE_BYTES) as pipeline:
        window = pipeline.window_bytes
        pool = np.zeros((LAYERS, 120, PAGE_BYTES), dtype=np.uint8)
        assert pipeline.submit(short_keys, pool, np.arange(2)).wait(WAIT) == 2
        assert pipeline.submit(long_keys, PagedPool(pool, np.arange(120))).wait(WAIT) == 120
        assert np.array_equal(pool, long_kv)
        assert pipeline.window_bytes == window and 0 < pipeline.high_water_bytes <= window


# ---- a lookup's lease handed to the restore (the engine's scheduler, then its worker) --------


def node_total(store, counter: str) -> int:
    return sum(stats.get(counter, 0) for stats in node_stats(store))


@pytest.mark.parametrize("medium", [Medium.DRAM, Medium.SSD])
def test_a_probe_that_leases_hands_its_lease_to_the_restore(store, medium):
    keys, kv = keys_for(12), random_kv(12, seed=7)
    store.put(keys, kv, session_id=keys[0], hints=HINTS[medium])
    lookups = node_total(store, "lookups")
    probe = store.probe(keys, lease=True)
    assert (probe.hits, probe.on_ssd) == (12, medium is Medium.SSD)
    out = np.zeros_like(kv)
    grant = pickle.loads(pickle.dumps(probe.grant))  # as it reaches an engine's worker process
    handle = store.restore(keys, out, np.arange(12), grant=grant)
    assert handle.wait(WAIT) == 12 and np.array_equal(out, kv)
    if isinstance(store, FlatCakeStore):
        assert probe.grant is None  # its lookups are local: nothing to carry
        return
    # One node call for both: the probe's lookup leased, the restore read under that lease
    # and released it.
    assert node_total(store, "lookups") - lookups == 1
    assert node_total(store, "leases_held") == 0


def test_a_grant_restores_only_the_keys_it_was_taken_for(ray_client):
    keys, kv = keys_for(6), random_kv(6, seed=8)
    ray_client.put(keys, kv, session_id=keys[0], hints=DRAM)
    grant = ray_client.probe(keys, lease=True).grant
    with pytest.raises(LeaseError, match="keys it was taken for"):
        ray_client.restore(keys[:5], np.zeros_like(kv), np.arange(5), grant=grant)
    with pytest.raises(LeaseError, match="not a lease grant"):
        ray_client.restore(keys, np.zeros_like(kv), np.arange(6), grant="lease 1")
    assert node_total(ray_client, "leases_held") == 1  # refused restores took nothing over
    ray_client.let_go(grant)  # sent alone when no lookup carries it soon
    wait_until(lambda: node_total(ray_client, "leases_held") == 0)


def test_an_in_process_store_hands_out_no_grants(tmp_path):
    with FlatCakeStore(small_config(tmp_path, dram_bytes=16 << 20)) as local:
        keys, kv = keys_for(3), random_kv(3, seed=9)
        local.put(keys, kv, hints=DRAM)
        assert local.probe(keys, lease=True).grant is None
        with pytest.raises(LeaseError):
            local.restore(keys, np.zeros_like(kv), np.arange(3), grant=object())
        with pytest.raises(LeaseError):
            local.let_go(object())
        assert local.get(keys, np.zeros_like(kv)) == 3  # nothing was taken or broken
