"""FlatCake-Ray as a tier of vLLM's native offloading, driven through vLLM's own tiering
manager (``TieringOffloadingSpec``) as its connector drives it: what vLLM's ``example`` and
``fs`` tiers do is the contract (cascade stores from the CPU tier, async lookups that say
RETRY until answered, promotions into the CPU tier, finished jobs reported once, partial
loads keep their prefix and the rest becomes a miss, drain, events, stats). Real bytes through
an in-process store and through the FlatCake-Ray service on a Ray of the test's own."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from tests.integrations.conftest import require_vllm

require_vllm()

from vllm.v1.kv_offload.base import LookupResult, Medium  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from flatcake_ray.errors import ConfigError  # noqa: E402
from flatcake_ray.integrations import _common  # noqa: E402
from flatcake_ray.integrations._common import Geometry  # noqa: E402
from flatcake_ray.integrations.vllm_tier import (  # noqa: E402
    FlatCakeTier,
    kv_transfer_config,
    tier_config,
)
from tests.integrations.vllm_tier_harness import (  # noqa: E402
    CHUNKS,
    WORKER_BLOCK_BYTES,
    NativeEngine,
    ShortReads,
    chunk_bytes,
    chunk_keys,
)


@pytest.fixture
def tier_options(store_kind, local_store_options, ray_services):
    """The tier's options: an in-process store, or the Ray service (a namespace per test)."""
    if store_kind == "local":
        return local_store_options
    options = ray_services(1, WORKER_BLOCK_BYTES)
    return {**options, "namespace": f"tier-{uuid.uuid4().hex[:8]}"}


@pytest.fixture
def engines():
    """``make(tier_entry, events=False)``: engines shut down (their regions unlinked) after."""
    made: list[NativeEngine] = []

    def make(entry, **options) -> NativeEngine:
        made.append(NativeEngine(entry, **options))
        return made[-1]

    yield make
    for engine in reversed(made):
        engine.shutdown()


def counter(stats, name: str, tier: str = "FlatCakeTier") -> float:
    values = stats.data["data"].get(name, {}) if stats is not None else {}
    # vLLM labels its own tiering series "<index>:<type>", the tier's own "<type>".
    return sum(value for labels, value in values.items() if any(tier in x for x in labels))


def test_one_entry_names_the_tier_and_vllm_builds_it():
    config = kv_transfer_config(8 << 30, store="ray", ray_namespace="flatcake")
    extra = config["kv_connector_extra_config"]
    assert config["kv_connector"] == "OffloadingConnector"
    assert OffloadingSpecFactory.get_spec_cls(extra) is TieringOffloadingSpec
    assert SecondaryTierFactory.get_tier_class(extra["secondary_tiers"][0]) is FlatCakeTier
    assert extra["secondary_tiers"][0] == tier_config(store="ray", ray_namespace="flatcake")
    metrics = TieringOffloadingSpec.build_metric_definitions(extra)
    assert "vllm:flatcake_tier_stored_blocks" in metrics
    assert TieringOffloadingMetrics.READ_BYTES in metrics


@pytest.mark.parametrize("store_kind", ["local", "ray"], indirect=True)
def test_a_second_engine_promotes_the_first_engines_chunks(tier_options, engines):
    """Engine A's CPU tier cascades four chunks into FlatCake; engine B, with an empty CPU
    tier, finds them through the index (RETRY first), promotes them through the restore
    engine and reads A's bytes. vLLM's own tiering metrics count the bytes moved."""
    keys = chunk_keys(4)
    first = engines(tier_config(**tier_options))
    context = first.request("turn-1", keys)
    first.store(context, keys)
    first.settle()
    stored = first.manager.get_stats()
    assert counter(stored, "vllm:flatcake_tier_stored_blocks") == 4
    assert counter(stored, TieringOffloadingMetrics.WRITE_BYTES) == 4 * WORKER_BLOCK_BYTES
    first.finish(context)

    second = engines(tier_config(**tier_options))
    context = second.request("turn-2", keys)
    assert second.manager.lookup(keys[0], context) is LookupResult.RETRY
    assert second.lookup(context, keys) == 4
    for got, key in zip(second.read(context, keys), keys, strict=True):
        assert np.array_equal(got, chunk_bytes(key))
    loaded = second.manager.get_stats()
    assert counter(loaded, "vllm:flatcake_tier_loaded_blocks") == 4
    assert counter(loaded, TieringOffloadingMetrics.READ_BYTES) == 4 * WORKER_BLOCK_BYTES
    assert counter(loaded, TieringOffloadingMetrics.CHUNK_HITS) == 4
    second.finish(context)


@pytest.mark.parametrize("store_kind", ["local"], indirect=True)
def test_lookups_stop_at_the_first_chunk_flatcake_lacks(tier_options, engines):
    keys = chunk_keys(4)
    first = engines(tier_config(**tier_options))
    first.store(first.request("short", keys[:2]), keys[:2])
    first.settle()
    second = engines(tier_config(**tier_options))
    context = second.request("long", keys)
    assert second.lookup(context, keys) == 2
    assert second.tier.counters.totals["lookup_hits"] == 2


@pytest.mark.parametrize("store_kind", ["local"], indirect=True)
def test_chunks_already_stored_are_skipped(tier_options, engines):
    """Write-once: a second engine cascading the same chunks stores nothing new."""
    keys = chunk_keys(3)
    for name in ("a", "b"):
        engine = engines(tier_config(**tier_options))
        engine.store(engine.request(name, keys), keys)
        engine.settle()
    assert engine.tier.counters.totals["skipped_blocks"] == 3
    assert engine.tier.counters.totals["stored_blocks"] == 0


@pytest.mark.parametrize("store_kind", ["local"], indirect=True)
def test_kv_events_name_the_placed_medium_and_withdraw_lost_chunks(tier_options, engines):
    """BlockStored as the connector's (the medium placement chose, ownership "flatcake"). Once
    the CPU tier evicted the chunks, a promotion that comes back one chunk short (a reclaimed
    scope) withdraws that chunk, and vLLM keeps the prefix it got and asks no more for it."""
    _common.register_store_opener(
        "short-reads", lambda options, geometry: ShortReads(_common._open_local(options, geometry))
    )
    keys = chunk_keys(3)
    engine = engines(tier_config(**{**tier_options, "store": "short-reads"}), events=True)
    engine.store(engine.request("a", keys), keys)
    engine.settle()
    (stored,) = [event for event in engine.manager.take_events() if event.ownership == "flatcake"]
    assert (stored.keys, stored.removed, stored.ownership) == (keys, False, "flatcake")
    assert stored.medium in (Medium.CPU, Medium.STORAGE)

    fillers = chunk_keys(CHUNKS, seed="filler")  # evict the three from the CPU tier
    engine.store(engine.request("filler", fillers), fillers)
    engine.settle()
    list(engine.manager.take_events())  # the fillers' (a generator: it runs when consumed)
    context = engine.request("b", keys)
    assert engine.lookup(context, keys) == 2
    ours = [event for event in engine.manager.take_events() if event.ownership == "flatcake"]
    assert [(event.keys, event.removed) for event in ours] == [([keys[2]], True)]
    assert engine.tier.counters.totals["failed_load_blocks"] == 1
    assert engine.manager.lookup(keys[2], context) is LookupResult.MISS


@pytest.mark.parametrize("store_kind", ["local"], indirect=True)
def test_a_session_turn_is_placed_from_what_the_request_tells(tier_options, engines):
    """``flatcake_turn`` / ``flatcake_prior_reply_tokens`` reach placement as the connector's
    saves do: a later turn after a short reply lands in DRAM, a first turn on SSD."""
    placed = {}
    for name, params in {
        "dram": {
            "flatcake_session": "chat-7",
            "flatcake_turn": 2,
            "flatcake_prior_reply_tokens": 16,
        },
        "ssd": {"flatcake_session": "chat-8", "flatcake_turn": 1},
    }.items():
        keys = chunk_keys(2, seed=name)
        engine = engines(tier_config(**tier_options))
        engine.store(engine.request(name, keys, **params), keys)
        engine.settle()
        placed[name] = {k: v for k, v in engine.tier.counters.totals.items() if "stored_" in k}
    assert placed["dram"]["stored_dram_blocks"] == 2
    assert placed["ssd"]["stored_ssd_blocks"] == 2
    store = _common.open_store(tier_options, Geometry(1, WORKER_BLOCK_BYTES))
    try:
        assert store.exists(chunk_keys(2, seed="dram"), namespace=engine.tier.namespace) == 2
    finally:
        _common.release_store(store)


@pytest.mark.parametrize("store_kind", ["local"], indirect=True)
def test_drain_leaves_every_job_reported(tier_options, engines):
    """vLLM's reset_cache drains every tier and asserts no job is left unreported."""
    keys = chunk_keys(4, seed="d")
    engine = engines(tier_config(**tier_options))
    engine.store(engine.request("d", keys), keys)
    engine.step()  # vLLM submits the cascade at the step's end
    engine.manager.reset_cache()
    assert not engine.tier.has_pending_work()
    assert engine.tier.counters.totals["stored_blocks"] == 4


@pytest.mark.parametrize("store_kind", ["local"], indirect=True)
def test_bad_options_are_typed_errors(tier_options, engines):
    with pytest.raises(ConfigError, match="does not split"):
        engines(tier_config(layers=3, **tier_options))
    with pytest.raises(ConfigError, match="tier_threads"):
        engines(tier_config(tier_threads=0, **tier_options))
    with pytest.raises(ConfigError, match="locality"):
        engines(tier_config(locality="NEARBY", **tier_options))


def test_the_serve_llm_example_attaches_the_tier(monkeypatch):
    """examples/serve_llm_native_tier.py's engine arguments: vLLM's native offloading with a
    CPU tier of the given size and FlatCake-Ray (the Ray service) below it."""
    import importlib
    import pathlib

    examples = pathlib.Path(__file__).resolve().parents[2] / "examples"
    monkeypatch.syspath_prepend(str(examples))
    example = importlib.import_module("serve_llm_native_tier")
    args = example.parser().parse_args(["--model", "m", "--cpu-tier-bytes", "2GiB"])
    config = example.engine_kwargs(args, "10.0.0.1:6379")["kv_transfer_config"]
    extra = config["kv_connector_extra_config"]
    assert (config["kv_connector"], extra["cpu_bytes_to_use"]) == ("OffloadingConnector", 2 << 30)
    (entry,) = extra["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(entry) is FlatCakeTier
    assert (entry["store"], entry["ray_address"], entry["layers"]) == ("ray", "10.0.0.1:6379", 1)
