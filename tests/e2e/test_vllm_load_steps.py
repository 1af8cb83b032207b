"""vLLM, offline, in-process store: how many engine steps a FlatCake hit costs.

An asynchronous load leaves its request waiting (WAITING_FOR_REMOTE_KVS) while vLLM steps
on; with nothing else to run, each step schedules no tokens and vLLM steps again at once.
That busy loop held the GIL the loader threads need, and stretched a DRAM hit's load from
milliseconds to 0.2-0.5 s. So the worker blocks on its loads in such an idle step
(``idle_wait_s``), and a hit, DRAM or SSD, costs one idle step: the load runs inside the
step that planned it, and the next step prefills. With ``load_async: auto`` a hit read from
DRAM, or a small one from SSD, loads inside the step (no idle step); only a read that
touches SSD and is bigger than ``in_step_ssd_bytes`` goes asynchronous.

Counts, not timings: ``idle_wait_s`` is raised far above any load here, so the one-step count
holds however loaded the machine is.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import require_vllm, store_options

require_vllm()

from flatcake_ray.integrations._common import Geometry, open_store, release_store  # noqa: E402
from flatcake_ray.integrations.vllm import kv_transfer_config  # noqa: E402
from tests.e2e import engines  # noqa: E402
from tests.e2e.engines import BLOCK, Completion  # noqa: E402
from tests.e2e.tiny_model import TINY, words  # noqa: E402

PREFIX_BLOCKS = 12
PREFIX_TOKENS = PREFIX_BLOCKS * BLOCK
HINTS = {  # FlatCake's write-time rules: a later turn after a short reply -> DRAM; a first -> SSD
    "dram": {"flatcake_turn": 2, "flatcake_prior_reply_tokens": 16},
    "ssd": {"flatcake_turn": 1},
}


def prompt(placement: str) -> tuple[list[int], list[int]]:
    start = 31 if placement == "dram" else 517
    prefix = words(PREFIX_TOKENS, start)
    return prefix, prefix + words(9, start + 3000)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    options = store_options(tmp_path_factory.mktemp("fc") / "store")
    held = open_store(options, Geometry(TINY.layers, TINY.page_bytes(BLOCK)))
    yield options, held
    release_store(held)


def _counters(llm, held) -> tuple[dict, dict, dict]:
    core = llm.llm_engine.engine_core.engine_core  # the in-process engine core
    return (
        held.stats(),
        dict(core.scheduler.connector.scheduler_side.counters),
        llm.collective_rpc(engines.worker_counters)[0],
    )


def _hit(llm, held, placement: str) -> tuple[Completion, dict, dict, dict]:
    """The answer to ``placement``'s prompt from FlatCake's pages (the engine's own prefix
    cache reset first), and what the store, the scheduler and the worker counted for it."""
    llm.reset_prefix_cache()
    before = _counters(llm, held)
    got = engines.generate(llm, prompt(placement)[1])
    # A load inside the step counts its reads as its restore ends, a moment after its last
    # layer is in place: wait for that count before reading the others.
    deadline = time.monotonic() + 30
    while held.stats()["hit_pages"] < before[0]["hit_pages"] + PREFIX_BLOCKS:
        assert time.monotonic() < deadline, "the load's restore never ended"
        time.sleep(0.01)
    after = _counters(llm, held)
    deltas = [
        {name: value - old.get(name, 0) for name, value in new.items() if isinstance(value, int)}
        for new, old in zip(after, before, strict=True)
    ]
    return (got, *deltas)


@pytest.fixture(scope="module")
def runs(tiny_model, one_process_engines, store):
    """Engine A (``load_async: auto``) saves both prefixes, answers from its own prefix
    cache (the reference), then from FlatCake; engine B loads every hit asynchronously."""
    from vllm import LLM

    options, held = store
    results: dict[str, dict] = {"reference": {}, "auto": {}, "always": {}}
    for mode in ("auto", "always"):
        config = kv_transfer_config(**options, load_async=mode, idle_wait_s=600)
        llm = LLM(
            **engines.engine_args(
                tiny_model, enable_prefix_caching=True, kv_transfer_config=config,
                **one_process_engines,
            )
        )  # fmt: skip
        try:
            for placement, hints in HINTS.items():
                if mode == "auto":
                    prefix, full = prompt(placement)
                    engines.generate(llm, prefix, hints)
                    results["reference"][placement] = engines.generate(llm, full)
                results[mode][placement] = _hit(llm, held, placement)
        finally:
            engines.shutdown(llm)
    return results


@pytest.mark.parametrize("mode", ["auto", "always"])
@pytest.mark.parametrize("placement", list(HINTS))
def test_a_hit_is_served_whole_and_computes_what_the_prefix_cache_hit_does(runs, mode, placement):
    got, _, scheduler, worker = runs[mode][placement]
    assert got.cached_tokens == PREFIX_TOKENS
    assert scheduler["hit_blocks"] == worker["loaded_pages"] == PREFIX_BLOCKS
    engines.assert_same_completion(got, runs["reference"][placement])


@pytest.mark.parametrize("placement", list(HINTS))
def test_an_async_load_costs_one_idle_step(runs, placement):
    """The load runs to its end inside the step that planned it (the worker waits for it
    instead of returning to vLLM's busy loop); the next step prefills."""
    _, _, scheduler, _ = runs["always"][placement]
    assert scheduler["async_loads"] == 1
    assert scheduler["idle_steps"] == 1


def test_auto_loads_a_dram_read_inside_the_step(runs):
    _, store_delta, scheduler, _ = runs["auto"]["dram"]
    assert store_delta["dram_bytes_read"] > 0 and store_delta["ssd_bytes_read"] == 0
    assert (scheduler["async_loads"], scheduler["idle_steps"]) == (0, 0)


def test_auto_loads_a_small_ssd_read_inside_the_step(runs):
    """A first turn is homed on SSD; this prefix (a few hundred KiB) is under ``auto``'s
    ``in_step_ssd_bytes`` (4 MiB), so it loads inside the step, read from SSD or from a DRAM
    replica of it: no idle step (tests/integrations hold the rule at its boundary)."""
    _, store_delta, scheduler, _ = runs["auto"]["ssd"]
    assert store_delta["ssd_bytes_read"] + store_delta["dram_bytes_read"] > 0
    assert (scheduler["async_loads"], scheduler["idle_steps"]) == (0, 0)
