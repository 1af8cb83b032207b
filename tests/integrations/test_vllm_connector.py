"""FlatCakeConnector driven by vLLM's own Scheduler and the model runner's call sequence."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from tests.integrations.conftest import require_vllm

require_vllm()

from flatcake_ray.errors import ConfigError  # noqa: E402
from flatcake_ray.integrations import _common  # noqa: E402
from flatcake_ray.integrations.vllm import kv_transfer_config  # noqa: E402
from flatcake_ray.restore import RestoreHandle, RestorePipeline  # noqa: E402
from flatcake_ray.restore.deliver import ChunkDelivery  # noqa: E402
from tests.integrations.vllm_harness import (  # noqa: E402
    BLOCK,
    LAYER_NAMES,
    PAGE_BYTES,
    build_engine,
    prefix_kv,
)

PROMPT = list(range(100, 200))  # 3 full blocks and a partial one
HIT_BYTES = 4 * len(LAYER_NAMES) * PAGE_BYTES  # the second turn's hit: 4 blocks
ALWAYS_ASYNC_FROM_SSD = {"in_step_ssd_bytes": 0}  # auto's medium rule alone
REPLY = 40  # the reply completes block 4 (token 128) during decode
USER = [5, 6, 7, 8, 9]


@pytest.fixture
def store_options(store_kind, local_store_options, ray_services):
    """Options of an in-process store, or of the Ray service (its own connector namespace
    per test, so no test sees another's pages)."""
    if store_kind == "local":
        return local_store_options
    options = ray_services(len(LAYER_NAMES), PAGE_BYTES)
    return {**options, "namespace": f"test-{uuid.uuid4().hex[:8]}"}


def store_view(store) -> dict:
    """Placement rules and SSD bytes read, from either store: the Ray client reads SSD pages
    itself (its own tallies); the nodes place them."""
    stats = store.stats()
    if "nodes" not in stats:
        return {"rules": stats["placement_rules"], "ssd_bytes_read": stats["ssd_bytes_read"]}
    rules: dict[str, int] = {}
    for node in stats["nodes"].values():
        for rule, count in node["placement_rules"].items():
            rules[rule] = rules.get(rule, 0) + count
    ssd = sum(tally["bytes"] for path, tally in stats["paths"].items() if "ssd" in path)
    return {"rules": rules, "ssd_bytes_read": ssd}


def expected_block_bytes(tokens: list[int], blocks: int) -> list[torch.Tensor]:
    """What the stand-in model writes for blocks [0, blocks): [blocks, heads, BLOCK, 2*head]."""
    per_layer = []
    for layer in range(len(LAYER_NAMES)):
        rows = [prefix_kv(tokens, p)[layer] for p in range(blocks * BLOCK)]
        stacked = torch.stack(rows).view(blocks, BLOCK, *rows[0].shape).transpose(1, 2)
        per_layer.append(stacked.contiguous().view(torch.uint8))
    return per_layer


def first_turn(base_model, options) -> list[int]:
    engine = build_engine(base_model, options)
    request = engine.add_request("turn-1", PROMPT, max_tokens=REPLY)
    reply = engine.run(request)
    assert engine.worker.worker_side.counters["saved_pages"] == 4
    return reply


def second_turn(base_model, options, reply: list[int]):
    engine = build_engine(base_model, options)  # another instance: nothing cached locally
    tokens = PROMPT + reply + USER
    request = engine.add_request("turn-2", tokens, max_tokens=3)
    engine.run(request)
    return engine, tokens


def settled(read, timeout_s: float = 30.0):
    """``read()`` once it is truthy, else its value at the deadline: a restore inside the step
    counts its reads and releases its lease just after its last layer is in place, so a
    step can end a moment before either."""
    deadline = time.monotonic() + timeout_s
    while not (value := read()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


def assert_restored_exactly(engine, tokens: list[int]) -> None:
    assert engine.events[0] != "forward:turn-2:0+145"  # the prefix was not recomputed
    assert "forward:turn-2:128+17" in engine.events
    restored = engine.block_bytes("turn-2", 4)
    for got, want in zip(restored, expected_block_bytes(tokens, 4), strict=True):
        assert torch.equal(got, want)


def test_second_turn_restores_from_ssd_asynchronously(base_model, store_options):
    options = {**store_options, **ALWAYS_ASYNC_FROM_SSD}
    reply = first_turn(base_model, options)
    engine, tokens = second_turn(base_model, options, reply)

    scheduler_side = engine.connector.scheduler_side
    assert scheduler_side.counters["hit_blocks"] == 4
    assert scheduler_side.counters["async_loads"] == 1  # a first turn is placed on SSD
    assert "waiting_for_remote_kvs:turn-2" in engine.events
    assert "finished_recving:['turn-2']" in engine.events
    assert_restored_exactly(engine, tokens)
    assert engine.worker.worker_side.counters["pipelined_loads"] == 1  # on the loader thread
    view = store_view(engine.worker.worker_side.store)
    assert view["rules"].get("one-shot", 0) >= 1 and view["ssd_bytes_read"] > 0


def test_an_async_load_ends_inside_the_idle_step_that_started_it(base_model, store_options):
    """With nothing else to run, the worker waits for the load in that idle step instead of
    returning to vLLM's busy loop (which starves the loader threads of the GIL): the request
    waits one step, then prefills. ``idle_wait_s`` is far above any load here: counts hold."""
    options = {**store_options, **ALWAYS_ASYNC_FROM_SSD, "idle_wait_s": 600}
    reply = first_turn(base_model, options)
    engine, tokens = second_turn(base_model, options, reply)

    counters = engine.connector.scheduler_side.counters
    assert (counters["async_loads"], counters["idle_steps"]) == (1, 1)
    assert engine.events.count("waiting_for_remote_kvs:turn-2") == 1
    assert_restored_exactly(engine, tokens)


@pytest.mark.parametrize(
    ("in_step_bytes", "loads_async"), [(HIT_BYTES, False), (HIT_BYTES - 1, True)]
)
def test_auto_reads_an_ssd_hit_up_to_in_step_ssd_bytes_inside_the_step(
    base_model, local_store_options, in_step_bytes, loads_async
):
    """A small SSD read costs less inside the step than the engine step an asynchronous load
    adds to the request; the default (4 MiB) takes this hit (a few KiB) in the step."""
    options = {**local_store_options, "in_step_ssd_bytes": in_step_bytes}
    reply = first_turn(base_model, options)
    engine, tokens = second_turn(base_model, options, reply)

    assert engine.connector.scheduler_side.counters["async_loads"] == int(loads_async)
    assert ("waiting_for_remote_kvs:turn-2" in engine.events) is loads_async
    assert settled(lambda: store_view(engine.worker.worker_side.store)["ssd_bytes_read"]) > 0
    assert_restored_exactly(engine, tokens)


@pytest.mark.parametrize("value", [-1, "lots", 1.5])
def test_in_step_ssd_bytes_must_be_a_size(base_model, local_store_options, value):
    with pytest.raises(ConfigError, match="in_step_ssd_bytes"):
        build_engine(base_model, {**local_store_options, "in_step_ssd_bytes": value})


def test_synchronous_load_feeds_the_same_step(base_model, store_options):
    options = {**store_options, "load_async": "never"}
    reply = first_turn(base_model, options)
    engine, tokens = second_turn(base_model, options, reply)

    assert engine.connector.scheduler_side.counters["async_loads"] == 0
    assert not any(event.startswith("waiting_for_remote_kvs") for event in engine.events)
    assert_restored_exactly(engine, tokens)


def record_layer_waits(engine, monkeypatch) -> list[tuple[str, int]]:
    """("attention", l) as the model runner reaches layer l, ("waited", l) as the pipelined
    restore's handle waits for layer l."""
    seen: list[tuple[str, int]] = []
    reach = engine.worker.wait_for_layer_load
    real_wait = RestoreHandle.wait_for_layer

    def attention(layer_name):
        seen.append(("attention", LAYER_NAMES.index(layer_name)))
        reach(layer_name)

    def wait_for_layer(self, layer, timeout=None):
        seen.append(("waited", layer))
        return real_wait(self, layer, timeout)

    monkeypatch.setattr(engine.worker, "wait_for_layer_load", attention)
    monkeypatch.setattr(RestoreHandle, "wait_for_layer", wait_for_layer)
    return seen


def test_synchronous_load_waits_for_each_layer_in_the_pipeline(
    base_model, store_options, store_kind, monkeypatch
):
    # A slot smaller than a layer: each layer is its own group, read as attention needs it.
    prefix = "store" if store_kind == "local" else "ray"
    options = {**store_options, "load_async": "never", f"{prefix}_restore_slot_bytes": "16KiB"}
    reply = first_turn(base_model, options)
    engine = build_engine(base_model, options)
    seen = record_layer_waits(engine, monkeypatch)
    tokens = PROMPT + reply + USER
    engine.run(engine.add_request("turn-2", tokens, max_tokens=3))

    worker_side = engine.worker.worker_side
    pipeline = worker_side.store.pipeline()
    assert isinstance(pipeline, RestorePipeline) and pipeline.slot_bytes == 16 << 10
    assert worker_side.counters["pipelined_loads"] == 1
    waits = [i for i, (kind, _) in enumerate(seen) if kind == "waited"]
    # One wait per layer, in order, each inside that layer's wait_for_layer_load.
    assert [seen[i][1] for i in waits] == list(range(len(LAYER_NAMES)))
    assert all(seen[i - 1] == ("attention", seen[i][1]) for i in waits)
    # The engine runs on once every layer is in place; the restore ends (lease released,
    # window freed) on the window's own thread just after, so give it a moment.
    deadline = time.monotonic() + 10
    while pipeline.scheduler.stats().prefetches_completed < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pipeline.scheduler.stats().prefetches_completed == 1  # an SSD restore
    assert worker_side.counters["loaded_pages"] == 4 and worker_side.counters["failed_pages"] == 0
    assert_restored_exactly(engine, tokens)


def test_a_failed_pipelined_restore_is_recomputed(base_model, local_store_options, monkeypatch):
    options = {**local_store_options, "load_async": "never"}
    reply = first_turn(base_model, options)
    real_deliver = ChunkDelivery.deliver

    def deliver(self, job, chunk, slot, stats):
        if chunk.done_layer is not None:
            raise RuntimeError("scatter lost")
        real_deliver(self, job, chunk, slot, stats)

    monkeypatch.setattr(ChunkDelivery, "deliver", deliver)  # before the lanes bind it
    engine = build_engine(base_model, options, kv_load_failure_policy="recompute")
    tokens = PROMPT + reply + USER
    engine.run(engine.add_request("turn-2", tokens, max_tokens=1))
    assert engine.worker.worker_side.counters["failed_pages"] == 4
    assert any(e.startswith("forward:turn-2:0+") for e in engine.events)  # from the start
    for got, want in zip(
        engine.block_bytes("turn-2", 4), expected_block_bytes(tokens, 4), strict=True
    ):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("load_async", "lease_in_lookup"), [("never", True), ("always", True), ("never", False)]
)
def test_a_hit_over_ray_is_one_node_lookup(base_model, ray_services, load_async, lease_in_lookup):
    """The scheduler's lookup leases the hit; the worker restores under that lease (no call
    of its own) and releases it, in the step or on its loader thread. Where several workers
    read one shard (MLA's ranks, pipeline stages: ``lease_in_lookup`` off) the scheduler
    probes and each worker leases for itself."""
    options = {
        **ray_services(len(LAYER_NAMES), PAGE_BYTES),
        "namespace": f"test-{uuid.uuid4().hex[:8]}",
        "load_async": load_async,
    }
    reply = first_turn(base_model, options)
    engine = build_engine(base_model, options)
    engine.connector.scheduler_side.lease_in_lookup = lease_in_lookup
    store = engine.worker.worker_side.store
    before = node_totals(store)
    tokens = PROMPT + reply + USER
    engine.run(engine.add_request("turn-2", tokens, max_tokens=3))

    after = node_totals(store)
    calls = (after["lookups"] - before["lookups"], after["exists_calls"] - before["exists_calls"])
    assert calls == ((1, 0) if lease_in_lookup else (1, 1))
    assert settled(lambda: node_totals(store)["leases_held"] == 0)
    assert engine.connector.scheduler_side.counters["grants_let_go"] == 0
    assert_restored_exactly(engine, tokens)


def test_the_worker_warms_its_store_up_as_vllm_registers_its_kv_caches(base_model, ray_services):
    """An engine's worker warms its store up when vLLM registers its KV caches (``KVStore.
    warm_up``): over Ray its client maps its node's arena then, so the next turn's restore
    and saves ask the node for no chunk in a step (a first write into a chunk of 4 KiB pages
    filled its page tables there: 70-140 ms a 1.2 GB chunk)."""
    options = {
        **ray_services(len(LAYER_NAMES), PAGE_BYTES),
        "namespace": f"test-{uuid.uuid4().hex[:8]}",
        "load_async": "never",
    }
    reply = first_turn(base_model, options)  # its tenant holds arena chunks now
    engine = build_engine(base_model, options)
    store = engine.worker.worker_side.store
    before = handouts(store)
    tokens = PROMPT + reply + USER
    engine.run(engine.add_request("turn-2", tokens, max_tokens=3))
    assert engine.worker.worker_side.counters["loaded_pages"] == 4
    assert handouts(store) == before
    assert_restored_exactly(engine, tokens)


def handouts(store) -> int:
    return sum(node["chunk_handouts"] for node in store.stats()["nodes"].values())


def node_totals(store) -> dict[str, int]:
    nodes = store.stats()["nodes"].values()
    return {
        name: sum(n[name] for n in nodes) for name in ("lookups", "exists_calls", "leases_held")
    }


def test_hit_sources_name_the_medium(base_model, store_options):
    reply = first_turn(base_model, store_options)
    engine = build_engine(base_model, store_options)
    request = engine.add_request("probe", PROMPT + reply + USER, max_tokens=1)
    connector = engine.connector
    assert connector.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, False)  # in step
    sources = connector.get_external_cache_hit_sources(request, 4 * BLOCK)
    assert {source.value: count for source, count in sources.items()} == {"disk": 4 * BLOCK}


def test_cache_salt_keeps_tenants_apart(base_model, local_store_options):
    reply = first_turn(base_model, local_store_options)
    engine = build_engine(base_model, local_store_options)
    tokens = PROMPT + reply + USER
    other = engine.add_request("other-tenant", tokens, max_tokens=1, cache_salt="tenant-b")
    assert engine.connector.get_num_new_matched_tokens(other, 0) == (0, False)
    same = engine.add_request("same-tenant", tokens, max_tokens=1)
    assert engine.connector.get_num_new_matched_tokens(same, 0) == (4 * BLOCK, False)


class ShortHandle:
    """A restore that delivers one page less than it holds, as after a reclaimed scope."""

    def __init__(self, handle):
        self.handle = handle
        self.hits = handle.hits

    def wait_for_layer(self, layer, timeout=None):
        return max(self.handle.wait_for_layer(layer, timeout) - 1, 0)


class ShortReads:
    def __init__(self, store):
        self.store = store

    def __getattr__(self, name):
        return getattr(self.store, name)

    def restore(self, keys, dest, *args, **options):
        return ShortHandle(self.store.restore(keys, dest, *args, **options))


def test_pages_lost_before_the_load_are_recomputed(base_model, local_store_options):
    reply = first_turn(base_model, local_store_options)
    _common.register_store_opener(
        "short-reads", lambda options, geometry: ShortReads(_common._open_local(options, geometry))
    )
    options = {**local_store_options, "store": "short-reads", "load_async": "never"}
    engine = build_engine(base_model, options, kv_load_failure_policy="recompute")
    tokens = PROMPT + reply + USER
    request = engine.add_request("turn-2", tokens, max_tokens=1)
    engine.run(request)
    assert engine.worker.worker_side.counters["failed_pages"] == 1
    assert any(e.startswith("forward:turn-2:96+") for e in engine.events)  # block 4 again
    for got, want in zip(
        engine.block_bytes("turn-2", 4), expected_block_bytes(tokens, 4), strict=True
    ):
        assert torch.equal(got, want)


def test_random_hash_seed_is_refused(base_model, local_store_options, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        build_engine(base_model, local_store_options, hash_algo="xxhash")


def test_configuration_dict_names_this_module():
    config = kv_transfer_config(store="ray", ray_namespace="flatcake")
    assert config["kv_connector_module_path"] == "flatcake_ray.integrations.vllm"
    assert config["kv_connector_extra_config"] == {"store": "ray", "ray_namespace": "flatcake"}


def test_sha256_block_hashes_need_no_seed(base_model, local_store_options, monkeypatch):
    """vLLM >= 0.32 seeds sha256 block hashes with a fixed value when PYTHONHASHSEED is unset,
    so the connector starts; xxhash stays refused (test above)."""
    from flatcake_ray.integrations._vllm_compat import hash_seed_problem

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert hash_seed_problem("sha256") is None
    assert "xxhash" in hash_seed_problem("xxhash")
    build_engine(base_model, local_store_options, hash_algo="sha256")


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_in_process_store_under_a_multiprocess_executor_names_store_ray(backend):
    from types import SimpleNamespace

    from vllm.config import ParallelConfig

    from flatcake_ray.integrations._vllm_compat import check_store_layout

    config = SimpleNamespace(parallel_config=ParallelConfig(distributed_executor_backend=backend))
    with pytest.raises(ConfigError, match="store: ray"):
        check_store_layout(config, "local")
    check_store_layout(config, "ray")


@pytest.mark.parametrize("hold", [True, False])
def test_a_turn_waiting_behind_its_predecessor_reads_the_prefix_once(
    base_model, local_store_options, hold
):
    """Both wait: the first for its SSD load (asynchronous), the second behind it."""
    options = {**local_store_options, **ALWAYS_ASYNC_FROM_SSD, "hold_shared_prefixes": hold}
    reply = first_turn(base_model, options)
    engine = build_engine(base_model, options)
    first = PROMPT + reply + USER
    second = PROMPT + reply + [11, 12, 13]  # the same 4 stored blocks, another question
    requests = [engine.add_request("a", first, max_tokens=2), engine.add_request("b", second, 2)]
    for request in requests:
        engine.run(request)

    counters = engine.connector.scheduler_side.counters
    loads = 1 if hold else 2  # the held turn finds the blocks in vLLM's prefix cache
    assert counters["hit_blocks"] == 4 * loads
    assert engine.worker.worker_side.counters["loaded_pages"] == 4 * loads
    assert (counters["held_lookups"] > 0) is hold
    shipped = sum(stats.get("held_lookups", 0) for stats in engine.connector_stats)
    assert shipped == counters["held_lookups"]  # in vLLM's stats, so in Prometheus
    assert f"forward:b:128+{len(second) - 128}" in engine.events  # only past the prefix
    for req_id, tokens in (("a", first), ("b", second)):
        for got, want in zip(
            engine.block_bytes(req_id, 4), expected_block_bytes(tokens, 4), strict=True
        ):
            assert torch.equal(got, want)


def test_a_turn_behind_an_in_step_load_takes_its_blocks_from_vllms_prefix_cache(
    base_model, local_store_options
):
    """A load inside the step fills blocks vLLM caches at once: the next request of the same
    step finds them in its own prefix cache, with no hold and no second read."""
    reply = first_turn(base_model, local_store_options)
    engine = build_engine(base_model, local_store_options)
    first = PROMPT + reply + USER
    second = PROMPT + reply + [11, 12, 13]
    requests = [engine.add_request("a", first, max_tokens=2), engine.add_request("b", second, 2)]
    for request in requests:
        engine.run(request)

    counters = engine.connector.scheduler_side.counters
    assert (counters["hit_blocks"], counters["held_lookups"], counters["async_loads"]) == (4, 0, 0)
    assert engine.worker.worker_side.counters["loaded_pages"] == 4
    assert f"forward:b:128+{len(second) - 128}" in engine.events
    for req_id, tokens in (("a", first), ("b", second)):
        for got, want in zip(
            engine.block_bytes(req_id, 4), expected_block_bytes(tokens, 4), strict=True
        ):
            assert torch.equal(got, want)


def test_a_held_turn_reads_for_itself_once_its_holder_is_aborted(base_model, local_store_options):
    from vllm.v1.request import RequestStatus

    options = {**local_store_options, **ALWAYS_ASYNC_FROM_SSD}  # the holder waits for its KV
    reply = first_turn(base_model, options)
    engine = build_engine(base_model, options)
    tokens = PROMPT + reply + USER
    holder = engine.add_request("a", tokens, max_tokens=2)
    held = engine.add_request("b", tokens, max_tokens=2)
    engine.step()
    assert holder.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert held.status == RequestStatus.WAITING and engine.connector.scheduler_side.is_held("b")
    engine.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert not engine.connector.scheduler_side.is_held("b")
    engine.run(held)
    assert engine.connector.scheduler_side.counters["hit_blocks"] == 8  # a's load, then b's
    for got, want in zip(engine.block_bytes("b", 4), expected_block_bytes(tokens, 4), strict=True):
        assert torch.equal(got, want)


def test_hold_option_must_be_a_bool(base_model, local_store_options):
    with pytest.raises(ConfigError, match="hold_shared_prefixes"):
        build_engine(base_model, {**local_store_options, "hold_shared_prefixes": "sometimes"})
