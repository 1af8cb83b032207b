"""FlatCake's figures and KV events in vLLM's own machinery (vLLM 0.33's classes).

The stats object as vLLM's logger, its Prometheus logger and its executor use it; the KV
events as vLLM's executor merges tensor-parallel workers' and as the real Scheduler
publishes them (to a ZMQ subscriber on 127.0.0.1).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.integrations.conftest import require_vllm

require_vllm()

from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from vllm.v1.metrics.prometheus import unregister_vllm_metrics  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402

from flatcake_ray.core.gva import Medium  # noqa: E402
from flatcake_ray.errors import ConfigError  # noqa: E402
from flatcake_ray.integrations._common import Geometry, open_store, release_store  # noqa: E402
from flatcake_ray.integrations._vllm_events import Announcement, FlatCakeKVEvents  # noqa: E402
from flatcake_ray.integrations._vllm_stats import FIELDS, metric_name  # noqa: E402
from flatcake_ray.integrations.vllm import FlatCakeConnector  # noqa: E402
from tests.integrations.vllm_harness import (  # noqa: E402
    BLOCK,
    LAYER_NAMES,
    PAGE_BYTES,
    build_engine,
    build_vllm_config,
    shutdown_engines,
)
from tests.vllm_kv_events import KVEventSubscriber  # noqa: E402

PROMPT = list(range(300, 400))  # 3 full blocks and a partial one
BLOCK_BYTES = len(LAYER_NAMES) * PAGE_BYTES

counts = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.integers(0, 1 << 40))


@pytest.fixture
def prometheus():
    """vLLM's metrics leave the process-wide registry as they would for the next engine."""
    unregister_vllm_metrics()
    yield
    unregister_vllm_metrics()


@settings(max_examples=60, deadline=None)
@given(first=counts, second=counts)
def test_stats_aggregate_reduce_and_is_empty(first, second):
    stats = FlatCakeConnector.build_kv_connector_stats(dict(first))
    stats = stats.aggregate(FlatCakeConnector.build_kv_connector_stats(dict(second)))
    summed = {name: first.get(name, 0) + second.get(name, 0) for name in FIELDS}
    assert stats.reduce() == {name: value for name, value in summed.items() if value}
    assert stats.is_empty() == (not any(summed.values()))
    shipped = FlatCakeConnector.build_kv_connector_stats(stats.to_dict())
    assert shipped.reduce() == stats.reduce()
    stats.reset()
    assert stats.is_empty()


def test_stats_of_an_unknown_field_are_refused():
    with pytest.raises(ConfigError, match="no fields"):
        FlatCakeConnector.build_kv_connector_stats({"loads": 1, "teleported_blocks": 2})


def test_vllms_logger_and_prometheus_take_the_stats(base_model, local_store_options, prometheus):
    from prometheus_client import REGISTRY

    config = build_vllm_config(base_model, local_store_options)
    payloads = [{"load_blocks": 3, "load_bytes": 3 * BLOCK_BYTES}, {"load_blocks": 2, "loads": 1}]
    logging = KVConnectorLogging(config.kv_transfer_config)
    for payload in payloads:
        logging.observe(payload)
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == [f"KV Transfer metrics: loads=1, load_blocks=5, load_bytes={3 * BLOCK_BYTES}"]

    labels = {0: ["tiny", "0"], 1: ["tiny", "1"]}
    prom = KVConnectorProm(config, ["model_name", "engine"], labels)
    for payload in payloads:
        prom.observe(payload, engine_idx=1)

    def sample(field: str, engine: str) -> float | None:
        return REGISTRY.get_sample_value(
            metric_name(field), {"model_name": "tiny", "engine": engine}
        )

    assert sample("load_blocks", "1") == 5 and sample("load_blocks", "0") == 0
    assert sample("load_bytes", "1") == 3 * BLOCK_BYTES and sample("save_failures", "1") == 0


def announcement(first_hash: int, blocks: int) -> Announcement:
    hashes = tuple((first_hash + i).to_bytes(32, "big") for i in range(blocks))
    return Announcement(hashes, None, tuple(range(blocks * BLOCK)), BLOCK, None, None, (), None)


def worker_output(saved: list[tuple[Announcement, Medium | None]]) -> ModelRunnerOutput:
    events = FlatCakeKVEvents()
    events.add_events([a.stored(medium) for a, medium in saved])
    return ModelRunnerOutput(
        req_ids=[],
        req_id_to_index={},
        kv_connector_output=KVConnectorOutput(kv_cache_events=events),
    )


def test_tensor_parallel_workers_announce_what_every_shard_saved(base_model, local_store_options):
    """vLLM's executor merges two ranks' events; the scheduler side publishes a block only
    once both shards saved it, naming the slower medium when the shards' media differ."""
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    engine = build_engine(base_model, local_store_options, kv_events=events)
    both, mixed, one = announcement(0, 2), announcement(100, 1), announcement(200, 3)
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(
        [
            worker_output([(both, Medium.DRAM), (mixed, Medium.DRAM), (one, Medium.DRAM)]),
            worker_output([(both, Medium.DRAM), (mixed, Medium.SSD)]),
        ]
    )
    engine.connector.update_connector_output(merged.kv_connector_output)
    published = list(engine.connector.take_events())
    assert published == [both.stored(Medium.DRAM), mixed.stored(Medium.SSD)]
    assert list(engine.connector.take_events()) == []  # taken once


def total(engine, field: str) -> int:
    return sum(stats.get(field, 0) for stats in engine.connector_stats)


def test_scheduler_publishes_saves_and_withdraws_what_the_store_lost(
    base_model, local_store_options
):
    """Through vLLM's Scheduler and its ZMQ publisher: a first turn's blocks are announced
    (FlatCake SSD); the store reclaims them; the next lookup withdraws them and the blocks,
    saved again, are announced again."""
    subscriber = KVEventSubscriber()
    store = open_store(local_store_options, Geometry(len(LAYER_NAMES), PAGE_BYTES))
    try:
        engine = build_engine(
            base_model, local_store_options, kv_events=KVEventsConfig(**subscriber.config())
        )
        subscriber.wait_connected()
        first = engine.add_request("turn-1", PROMPT, max_tokens=2)
        engine.run(first)
        assert store.catalog.reclaim(Medium.SSD, 0.0)
        engine.run(engine.add_request("again", PROMPT, max_tokens=2))

        def flatcake(events):
            return [e for e in events if getattr(e, "ownership", None) == "flatcake"]

        events = flatcake(subscriber.receive(lambda seen: len(flatcake(seen)) >= 3))
        stored, removed, again = events[:3]
        assert isinstance(stored, BlockStored) and stored.medium == "STORAGE"
        assert stored.block_hashes == [maybe_convert_block_hash(h) for h in first.block_hashes[:3]]
        assert stored.token_ids == PROMPT[: 3 * BLOCK] and stored.block_size == BLOCK
        assert type(removed).__name__ == "BlockRemoved"
        assert (removed.block_hashes, removed.medium) == (stored.block_hashes, "STORAGE")
        assert again.block_hashes == stored.block_hashes
        assert total(engine, "save_blocks") == total(engine, "announced_blocks") == 6
        assert total(engine, "save_bytes") == 6 * BLOCK_BYTES
        assert total(engine, "withdrawn_blocks") == 3
        assert total(engine, "lookups") == 2
        assert subscriber.live_batches >= 1
    finally:
        shutdown_engines()
        release_store(store)
        subscriber.close()


def test_a_save_trimmed_to_its_new_blocks_announces_only_those():
    """Two requests filling the same prefix in one step: the second saves (and announces)
    only its tail, continuing the first's last shared block."""
    from flatcake_ray.core.catalog import PutHints
    from flatcake_ray.integrations._vllm_scheduler import SaveSpec, _drop_repeated_keys

    def save(req_id: str, blocks: int) -> SaveSpec:
        keys = tuple(i.to_bytes(32, "big") for i in range(blocks))
        return SaveSpec(
            req_id, keys, tuple(range(blocks)), "", None, None, PutHints(), announcement(0, blocks)
        )

    first, second = _drop_repeated_keys([save("a", 2), save("b", 3)])
    assert second.announce.stored(None).block_hashes == [(2).to_bytes(32, "big")]
    assert second.announce.parent_block_hash == (1).to_bytes(32, "big") == second.parent
    assert second.announce.token_ids == tuple(range(2 * BLOCK, 3 * BLOCK))
    assert first.announce == announcement(0, 2)
