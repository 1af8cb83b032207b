"""vLLM, offline, with an in-process store: engine A saves a prefix, a fresh engine B (its own
prefix cache off) restores it from FlatCake and must compute exactly what A computes on a
hit in vLLM's own prefix cache. One prefix is placed on DRAM, one on SSD (asynchronous load).

Both engines run in this process (``uni`` executor, no engine-core process), one after the
other; the test holds the store open between them, as a long-lived engine process would.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import require_vllm, store_options

require_vllm()

from flatcake_ray.core.gva import Medium  # noqa: E402
from flatcake_ray.errors import ConfigError  # noqa: E402
from flatcake_ray.integrations._common import Geometry, open_store, release_store  # noqa: E402
from flatcake_ray.integrations.vllm import kv_transfer_config  # noqa: E402
from tests.e2e import engines  # noqa: E402
from tests.e2e.engines import BLOCK, Completion  # noqa: E402
from tests.e2e.tiny_model import HEAD_DIM, KV_HEADS, LAYERS, words  # noqa: E402

PREFIX_BLOCKS = 20
PREFIX_TOKENS = PREFIX_BLOCKS * BLOCK
NEW_TOKENS = 24  # under one block: the prompt's loadable blocks are exactly the prefix's
PAGE_BYTES = 2 * BLOCK * KV_HEADS * HEAD_DIM * 2  # K and V of one block, one layer, bf16
PLACEMENTS = {
    # FlatCake's write-time rules (Table 2): a later chat turn after a short reply -> DRAM,
    # a first turn (one-shot until proven otherwise) -> SSD.
    "dram": {"flatcake_turn": 2, "flatcake_prior_reply_tokens": 16},
    "ssd": {"flatcake_turn": 1},
}


def prompts(placement: str) -> tuple[list[int], list[int]]:
    start = 11 if placement == "dram" else 400
    prefix = words(PREFIX_TOKENS, start)
    return prefix, prefix + words(NEW_TOKENS, start + 5000)


def shared_prompts() -> tuple[list[int], list[list[int]]]:
    """A prefix and two prompts continuing it differently (two turns waiting together)."""
    prefix = words(PREFIX_TOKENS, 700)
    return prefix, [prefix + words(NEW_TOKENS, 5700), prefix + words(NEW_TOKENS, 6700)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The test's own hold on the in-process store, so it outlives engine A."""
    options = store_options(tmp_path_factory.mktemp("fc") / "store")
    held = open_store(options, Geometry(LAYERS, PAGE_BYTES))
    yield options, held
    release_store(held)


def _scheduler_counters(llm) -> dict[str, int]:
    core = llm.llm_engine.engine_core.engine_core  # in-process engine core
    return dict(core.scheduler.connector.scheduler_side.counters)


def _delta(after: dict, before: dict) -> dict:
    return {
        name: value - before.get(name, 0)
        for name, value in after.items()
        if isinstance(value, (int, float))
    }


# Two turns waiting together in C: the first loads the prefix from FlatCake's SSD and
# prefills alone; the second is held until then, and joins the batch at the next step. The
# reference is computed in these same batches (CPU kernels are not batch-invariant: another
# batching gives other low bits), and C must have run exactly them.
PAIR_ARRIVALS = [0, 1]


@pytest.fixture(scope="module")
def runs(tiny_model, one_process_engines, store):
    """A saves both prefixes and answers the prompts from its own prefix cache (reference);
    then B, fresh and with prefix caching off, answers them with FlatCake's pages."""
    from vllm import LLM

    options, held = store
    # Every SSD hit loads asynchronously (auto's medium rule alone; by default a prefix this
    # small would load inside the step): the pair's schedule below is the one of that path.
    config = kv_transfer_config(**options, in_step_ssd_bytes=0)
    common = {"kv_transfer_config": config, **one_process_engines}
    llm_a = LLM(**engines.engine_args(tiny_model, enable_prefix_caching=True, **common))
    reference: dict[str, Completion] = {}
    shared_prefix, pair = shared_prompts()
    try:
        for placement, hints in PLACEMENTS.items():
            prefix, prompt = prompts(placement)
            engines.generate(llm_a, prefix, hints)
            reference[placement] = engines.generate(llm_a, prompt, hints)
        engines.generate(llm_a, shared_prefix, PLACEMENTS["ssd"])
        pair_reference = engines.generate_on_schedule(llm_a, pair, PAIR_ARRIVALS)
    finally:
        engines.shutdown(llm_a)
    # C: a fresh engine with its prefix cache on, given both prompts at once.
    llm_c = LLM(**engines.engine_args(tiny_model, enable_prefix_caching=True, **common))
    try:
        before = _counters(llm_c, held)
        pair_got = engines.generate_together_scheduled(llm_c, pair)
        pair_delta = [_delta(a, b) for a, b in zip(_counters(llm_c, held), before, strict=True)]
    finally:
        engines.shutdown(llm_c)
    llm_b = LLM(**engines.engine_args(tiny_model, enable_prefix_caching=False, **common))
    try:
        restored = {placement: _restore(llm_b, held, placement) for placement in PLACEMENTS}
        yield {
            "reference": reference,
            "restored": restored,
            "llm_b": llm_b,
            "store": held,
            "pair": (pair_got, pair_reference, *pair_delta),
        }
    finally:
        engines.shutdown(llm_b)


def _counters(llm, store) -> tuple[dict, dict, dict]:
    return (
        store.stats(),
        _scheduler_counters(llm),
        llm.collective_rpc(engines.worker_counters)[0],
    )


def _restore(llm, store, placement: str) -> tuple[Completion, dict, dict, dict]:
    """B's answer, and what the store, B's scheduler and B's worker counted for it."""
    before = _counters(llm, store)
    got = engines.generate(llm, prompts(placement)[1])
    after = _counters(llm, store)
    return (got, *(_delta(a, b) for a, b in zip(after, before, strict=True)))


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_reference_is_a_hit_in_vllms_own_prefix_cache(runs, placement):
    assert runs["reference"][placement].cached_tokens == PREFIX_TOKENS


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_fresh_engine_computes_what_the_prefix_cache_hit_computes(runs, placement):
    got, store_delta, scheduler, worker = runs["restored"][placement]
    assert got.cached_tokens == PREFIX_TOKENS  # the whole prefix, in vLLM blocks
    assert scheduler["hit_blocks"] == PREFIX_BLOCKS
    assert worker["loaded_pages"] == PREFIX_BLOCKS
    assert worker["failed_pages"] == 0
    assert store_delta["hit_pages"] >= PREFIX_BLOCKS
    engines.assert_same_completion(got, runs["reference"][placement])


def test_prefix_placement_and_load_mode(runs):
    """The DRAM prefix was read from DRAM in the step; the SSD one from SSD, loaded
    asynchronously (vLLM ran other work while it came in)."""
    _, dram, dram_sched, _ = runs["restored"]["dram"]
    _, ssd, ssd_sched, _ = runs["restored"]["ssd"]
    assert dram["dram_bytes_read"] > 0 and dram["ssd_bytes_read"] == 0
    assert ssd["ssd_bytes_read"] > 0 and ssd["dram_bytes_read"] == 0
    assert (dram_sched["async_loads"], ssd_sched["async_loads"]) == (0, 1)


def test_two_prompts_waiting_together_read_their_ssd_prefix_once(runs):
    """The later prompt is held until the earlier one's prefill, then takes the prefix from
    vLLM's own prefix cache: one SSD read of it, as many bytes as B's one SSD restore; both
    compute, bit for bit, what A computes from its prefix cache in the same batches."""
    (got, schedule), (reference, reference_schedule), store_delta, scheduler, worker = runs["pair"]
    assert scheduler["held_lookups"] > 0
    assert scheduler["hit_blocks"] == worker["loaded_pages"] == PREFIX_BLOCKS
    assert store_delta["ssd_bytes_read"] == runs["restored"]["ssd"][1]["ssd_bytes_read"]
    assert [completion.cached_tokens for completion in got] == [PREFIX_TOKENS] * 2
    assert engines.arrivals_of(schedule, 2) == PAIR_ARRIVALS, schedule
    assert schedule == reference_schedule
    for completion, expected in zip(got, reference, strict=True):
        engines.assert_same_completion(completion, expected)


def _zero_one_page(store, block: int = 5) -> None:
    """Zero layer 0 of one block of the DRAM segment in the arena itself. (Swapping two whole
    blocks of a layer would not do: attention sums over the cached keys with their positions
    already rotated in, so a permutation of whole blocks changes at most the rounding.)"""
    segments = [s for s in store.catalog.segments.values() if s.medium is Medium.DRAM]
    assert len(segments) == 1, "A placed exactly one segment on DRAM"
    segment = segments[0]
    first = segment.offset + segment.layout.layer_offset(0) + block * PAGE_BYTES
    store.arena.view[first : first + PAGE_BYTES] = 0


def test_negative_control_corrupted_restore_fails_the_same_assertion(runs):
    """One stored page zeroed: the restore still delivers the whole prefix, and the same
    comparison must catch it."""
    _zero_one_page(runs["store"])
    bad = engines.generate(runs["llm_b"], prompts("dram")[1])
    assert bad.cached_tokens == PREFIX_TOKENS
    with pytest.raises(AssertionError, match="restored prefix changed"):
        engines.assert_same_completion(bad, runs["reference"]["dram"])


def test_in_process_store_under_the_multiprocess_executor_names_store_ray(tiny_model, store):
    """vLLM's default executor runs the worker in its own process: an in-process store
    cannot serve it, and the connector says to use store: ray."""
    from vllm.engine.arg_utils import EngineArgs

    from flatcake_ray.integrations._vllm_compat import check_store_layout

    args = engines.engine_args(tiny_model, distributed_executor_backend="mp")
    config = EngineArgs(**args).create_engine_config()
    with pytest.raises(ConfigError, match="store: ray"):
        check_store_layout(config, "local")
