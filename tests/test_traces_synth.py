"""The synthetic trace generator: its profiles reproduce the real traces' Table 1 rows and
reuse regimes, deterministically per seed, with prefix-chained dense ids."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from flatcake_ray.errors import ConfigError
from flatcake_ray.traces.readers import write_generic
from flatcake_ray.traces.records import Trace
from flatcake_ray.traces.stats import compute_stats
from flatcake_ray.traces.synth import SyntheticTrace, SynthOptions
from tests.test_traces import FULL_SIZE_ENV, within

# --- synthetic traces ------------------------------------------------------------------

CLAUDE_CODE = {
    "once_access_pct": 16.6,
    "reuse_distance_intervening_mean": 0.85,
    "reuse_distance_intervening_p99": 14,
    "mean_blocks_per_request": 3_421,
}


def test_agentic_small_scale_matches_claude_code_ratios() -> None:
    trace = SyntheticTrace(SynthOptions(profile="agentic", scale=0.01, seed=0))
    stats = compute_stats(trace)
    assert stats.sessions == 4 and within(stats.requests, 988, 0.15)
    for key, target in CLAUDE_CODE.items():
        assert within(stats.to_dict()[key], target, 0.10), (key, stats.to_dict()[key])
    assert within(100 - stats.hit_rate_pct, 100 - 98.31, 0.10)  # the miss rate, 1.69%
    assert stats.block_tokens == 64


def test_agentic_ratios_hold_across_seeds_at_small_scale() -> None:
    for seed in (1, 2, 3):
        stats = compute_stats(
            SyntheticTrace(SynthOptions(profile="agentic", scale=0.01, seed=seed))
        )
        assert 13.0 < stats.once_access_pct < 20.0
        assert within(stats.reuse_distance_intervening_mean, 0.85, 0.10)
        assert 9 <= stats.reuse_distance_intervening_p99 <= 20
        assert within(100 - stats.hit_rate_pct, 1.69, 0.25)


def test_agentic_tenth_scale_matches_claude_code_row() -> None:
    stats = compute_stats(SyntheticTrace(SynthOptions(profile="agentic", scale=0.1, seed=0)))
    assert stats.sessions == 39 and within(stats.requests, 9_883, 0.10)
    for key, target in CLAUDE_CODE.items():
        assert within(stats.to_dict()[key], target, 0.10), (key, stats.to_dict()[key])
    assert within(100 - stats.hit_rate_pct, 1.69, 0.10)


@pytest.mark.skipif(
    os.environ.get(FULL_SIZE_ENV) != "1", reason=f"full-size agentic trace: set {FULL_SIZE_ENV}=1"
)
def test_agentic_full_size_matches_claude_code_row() -> None:
    stats = compute_stats(SyntheticTrace(SynthOptions(profile="agentic", scale=1.0, seed=0)))
    assert stats.sessions == 393
    assert within(stats.requests, 98_827, 0.10) and within(stats.unique_blocks, 5_717_185, 0.10)
    for key, target in CLAUDE_CODE.items():
        assert within(stats.to_dict()[key], target, 0.10), (key, stats.to_dict()[key])
    assert within(100 - stats.hit_rate_pct, 1.69, 0.10)


def test_chat_profile_is_in_the_low_reuse_regime_like_mooncake() -> None:
    stats = compute_stats(SyntheticTrace(SynthOptions(profile="chat", scale=1.0, seed=0)))
    assert stats.sessions == 7_373 and within(stats.requests, 12_031, 0.10)
    assert within(stats.once_access_pct, 75.8, 0.10)
    assert within(stats.reuse_distance_mean, 728, 0.10)
    assert within(stats.reuse_distance_p99, 5_527, 0.15)
    assert within(stats.hit_rate_pct, 36.64, 0.10)
    assert stats.block_tokens == 512


def test_mixed_profile_has_sessions_that_turn_agentic() -> None:
    trace = Trace.from_requests(SyntheticTrace(SynthOptions(profile="mixed", scale=0.1, seed=0)))
    prefixes = {name.split("-")[0] for name in trace.session_names}
    assert prefixes == {"agentic", "switch", "chat"}
    switching = [c for c, name in enumerate(trace.session_names) if name.startswith("switch-")]
    assert switching
    for code in switching:
        rows = np.flatnonzero(trace.session_codes == code)
        rows = rows[np.argsort(trace.turns[rows])]
        growth = np.diff(trace.input_tokens[rows])
        # Chat first (short messages and replies), then agent steps (long tool outputs).
        assert (growth[:1] < 1_500).all() and (trace.output_tokens[rows[:2]] < 1_000).all()
        assert np.median(np.abs(growth[4:])) > 1_000


def test_synth_is_deterministic_per_seed(tmp_path: Path) -> None:
    paths = []
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        path = tmp_path / f"{name}.jsonl"
        write_generic(path, SyntheticTrace(SynthOptions(profile="mixed", scale=0.02, seed=seed)))
        paths.append(path.read_bytes())
    assert paths[0] == paths[1] and paths[0] != paths[2]


def test_scaled_trace_keeps_the_first_sessions_plans() -> None:
    def per_session_inputs(scale: float) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for r in SyntheticTrace(SynthOptions(profile="agentic", scale=scale, seed=2)):
            out.setdefault(r.session or "", []).append(r.input_tokens)
        return out

    small, larger = per_session_inputs(0.01), per_session_inputs(0.02)
    assert set(small) < set(larger)
    assert all(small[name] == larger[name] for name in small)


def test_synthetic_ids_are_prefix_chained_and_dense() -> None:
    trace = Trace.from_requests(SyntheticTrace(SynthOptions(profile="agentic", scale=0.01)))
    seen = np.zeros(int(trace.block_ids.max()) + 1, dtype=bool)
    for index in range(len(trace)):
        blocks = trace.blocks_of(index)
        known = seen[blocks]
        # A block seen before never follows an unseen one inside a request.
        assert not (known[1:] & ~known[:-1]).any()
        seen[blocks] = True
    assert seen.all()
    assert np.all(np.diff(trace.arrival_s) >= 0)


def test_context_scale_shrinks_contexts_and_keeps_reuse() -> None:
    base = compute_stats(SyntheticTrace(SynthOptions(profile="agentic", scale=0.01)))
    small = compute_stats(
        SyntheticTrace(SynthOptions(profile="agentic", scale=0.01, context_scale=0.25))
    )
    assert small.requests == base.requests
    assert within(small.mean_blocks_per_request, base.mean_blocks_per_request / 4, 0.10)
    assert within(small.reuse_distance_intervening_mean, 0.85, 0.10)
    assert abs(small.hit_rate_pct - base.hit_rate_pct) < 0.5


def test_bad_synth_options_are_config_errors() -> None:
    for options in (
        SynthOptions(profile="nope"),
        SynthOptions(scale=0),
        SynthOptions(qps=-1),
        SynthOptions(arrivals="bursty"),
        SynthOptions(context_scale=0),
    ):
        with pytest.raises(ConfigError):
            SyntheticTrace(options)
