"""What vLLM shows of FlatCake: its Prometheus metrics and its KV events, from a real engine.

One offline engine (its engine core in this process, stats on, KV events published over ZMQ
to a subscriber on 127.0.0.1) runs a short workload with an in-process store:

1. a prefix is answered and saved to FlatCake (DRAM);
2. vLLM's prefix cache is reset and a prompt extending the prefix is answered: the prefix
   is loaded from FlatCake;
3. FlatCake reclaims its DRAM, vLLM's prefix cache is reset again and the prompt is answered
   once more: the lookup misses, the prefix is recomputed and saved again (SSD, a first turn).

vLLM's Prometheus registry (what its ``/metrics`` serves) must show FlatCake's loads, saves,
bytes and withdrawals moved by exactly that, and the subscriber must receive ``BlockStored``
for the saved blocks (vLLM's own block hashes and tokens), ``BlockRemoved`` for them after the
reclaim, and ``BlockStored`` again.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import require_vllm, store_options

require_vllm()

from flatcake_ray.core.gva import Medium  # noqa: E402
from flatcake_ray.integrations._common import Geometry, open_store, release_store  # noqa: E402
from flatcake_ray.integrations.vllm import kv_transfer_config  # noqa: E402
from tests.e2e import engines  # noqa: E402
from tests.e2e.engines import BLOCK  # noqa: E402
from tests.e2e.tiny_model import HEAD_DIM, KV_HEADS, LAYERS, words  # noqa: E402
from tests.vllm_kv_events import KVEventSubscriber  # noqa: E402

PREFIX_BLOCKS = 8
PREFIX = words(PREFIX_BLOCKS * BLOCK, 907)
PROMPT = PREFIX + words(20, 6100)  # under one more block: the loadable blocks are the prefix's
PAGE_BYTES = 2 * BLOCK * KV_HEADS * HEAD_DIM * 2
PREFIX_BYTES = PREFIX_BLOCKS * LAYERS * PAGE_BYTES
DRAM_HINTS = {"flatcake_turn": 2, "flatcake_prior_reply_tokens": 16}
SSD_HINTS = {"flatcake_turn": 1}


def flatcake_figures() -> dict[str, float]:
    """FlatCake's counters as vLLM's Prometheus registry exposes them (``/metrics``' text,
    parsed), summed over their labels."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    figures: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if sample.name.startswith("vllm:flatcake_") and sample.name.endswith("_total"):
                short = sample.name.removeprefix("vllm:flatcake_").removesuffix("_total")
                figures[short] = figures.get(short, 0.0) + sample.value
    return figures


def flatcake_events(events: list, kind: str) -> list:
    return [e for e in events if type(e).__name__ == kind and e.ownership == "flatcake"]


@pytest.fixture(scope="module")
def observed(tiny_model, one_process_engines, tmp_path_factory):
    from vllm import LLM
    from vllm.config import KVEventsConfig

    options = store_options(tmp_path_factory.mktemp("fc") / "store")
    store = open_store(options, Geometry(LAYERS, PAGE_BYTES))  # the test's hold on it
    subscriber = KVEventSubscriber()
    args = engines.engine_args(
        tiny_model,
        enable_prefix_caching=True,
        disable_log_stats=False,
        kv_events_config=KVEventsConfig(**subscriber.config()),
        kv_transfer_config=kv_transfer_config(**options),
        **one_process_engines,
    )
    llm = LLM(**args)
    try:
        subscriber.wait_connected()
        figures = [flatcake_figures()]
        engines.generate(llm, PREFIX, DRAM_HINTS)
        figures.append(flatcake_figures())
        llm.reset_prefix_cache()
        engines.generate(llm, PROMPT)
        figures.append(flatcake_figures())
        assert store.catalog.reclaim(Medium.DRAM, 0.0), "the prefix's scope was on DRAM"
        llm.reset_prefix_cache()
        engines.generate(llm, PROMPT, SSD_HINTS)
        figures.append(flatcake_figures())
        events = subscriber.receive(lambda seen: len(flatcake_events(seen, "BlockStored")) >= 2)
        yield {"figures": figures, "events": events, "live": subscriber.live_batches}
    finally:
        engines.shutdown(llm)
        subscriber.close()
        release_store(store)


def moved(figures: list[dict[str, float]], step: int) -> dict[str, float]:
    after, before = figures[step], figures[step - 1]
    return {name: value - before.get(name, 0.0) for name, value in after.items() if value}


def test_prometheus_shows_the_save(observed):
    saved = moved(observed["figures"], 1)
    assert saved["save_blocks"] == PREFIX_BLOCKS
    assert saved["save_bytes"] == PREFIX_BYTES
    assert saved["announced_blocks"] == PREFIX_BLOCKS
    assert saved.get("load_blocks", 0) == 0 and saved.get("save_failures", 0) == 0


def test_prometheus_shows_the_load(observed):
    loaded = moved(observed["figures"], 2)
    assert loaded["loads"] == 1
    assert loaded["load_blocks"] == loaded["hit_blocks"] == PREFIX_BLOCKS
    assert loaded["load_bytes"] == PREFIX_BYTES
    assert loaded.get("load_failed_blocks", 0) == 0
    assert loaded.get("save_blocks", 0) == 0  # the prefix is stored already


def test_prometheus_shows_the_withdrawal_and_the_second_save(observed):
    again = moved(observed["figures"], 3)
    assert again["withdrawn_blocks"] == PREFIX_BLOCKS
    assert again["save_blocks"] == again["announced_blocks"] == PREFIX_BLOCKS
    assert again.get("load_blocks", 0) == 0
    assert again["lookups"] >= 1


def test_block_stored_names_the_saved_blocks_as_vllm_does(observed):
    events = observed["events"]
    first, second = flatcake_events(events, "BlockStored")[:2]
    gpu = [e for e in events if type(e).__name__ == "BlockStored" and e.medium == "GPU"]
    vllm_hashes = [h for event in gpu for h in event.block_hashes]
    assert first.block_hashes == vllm_hashes[:PREFIX_BLOCKS]  # the prefix cache's own hashes
    assert first.token_ids == PREFIX and first.block_size == BLOCK
    assert first.parent_block_hash is None
    assert (first.medium, second.medium) == ("CPU", "STORAGE")  # FlatCake DRAM, then SSD
    assert second.block_hashes == first.block_hashes


def test_events_arrive_on_the_subscription(observed):
    """Replay only fills in what the PUB socket may drop around the connection."""
    assert observed["live"] >= 1


def test_block_removed_follows_the_reclaim(observed):
    events = observed["events"]
    removed = flatcake_events(events, "BlockRemoved")
    stored = flatcake_events(events, "BlockStored")
    assert [event.block_hashes for event in removed] == [stored[0].block_hashes]
    assert removed[0].medium == "CPU"
    assert events.index(stored[0]) < events.index(removed[0]) < events.index(stored[1])
