"""The workload-aware tiered baseline (aware.py) and the goal check (goal.py)."""

from __future__ import annotations

import numpy as np

from flatcake_ray.replay.aware import PredictedLru, ReusePredictor
from flatcake_ray.replay.goal import goal_rows, goal_table
from flatcake_ray.replay.pages import digests_of
from tests.test_replay import replay, session_trace


def test_predictor_learns_each_sessions_gap():
    predictor = ReusePredictor(sessions=3)
    for t in (0.0, 2.0, 4.0):  # session 0: an agent, every 2 s
        predictor.observe(0, t)
    predictor.observe(1, 0.0)
    predictor.observe(1, 100.0)  # session 1: a chat, 100 s apart
    predictor.observe(2, 50.0)  # session 2: seen once
    next_use, gap = predictor.next_use(np.array([0, 1, 2, -1]))
    assert next_use[0] == 6.0 and next_use[1] == 200.0
    assert gap[2] == (2.0 + 100.0) / 2  # the mean first gap of sessions that came back
    assert next_use[3] == -np.inf
    assert predictor.return_rate == 2 / 3


def filled_lru(history: dict[int, tuple[float, ...]], order: tuple[int, ...]) -> PredictedLru:
    """64 pages per session, inserted in ``order`` (the first is least recently used)."""
    predictor = ReusePredictor(sessions=len(history))
    for session, times in history.items():
        for t in times:
            predictor.observe(session, t)
    lru = PredictedLru(capacity=64 * len(history), predictor=predictor)
    for session in order:
        lru.insert(digests_of(np.arange(session * 1000, session * 1000 + 64)), owner=session)
    return lru


def test_eviction_drops_overdue_sessions_first():
    # 0: an agent, every 2 s, last seen at 2 s; 1 and 2: back every 100 and 60 s
    lru = filled_lru({0: (0.0, 2.0), 1: (0.0, 100.0), 2: (30.0, 90.0)}, order=(2, 1, 0))
    lru.now = 105.0  # only the agent is overdue (twice its gap has passed)
    _, owners = lru.insert(digests_of(np.arange(9000, 9003)), owner=1)
    assert set(owners.tolist()) == {0}  # not the least recently used session (2)


def test_eviction_then_drops_the_furthest_predicted_use():
    # all last seen at 100 s; next uses predicted at 200, 150 and 110 s
    lru = filled_lru({0: (0.0, 100.0), 1: (50.0, 100.0), 2: (90.0, 100.0)}, order=(2, 0, 1))
    lru.now = 101.0
    _, owners = lru.insert(digests_of(np.arange(9000, 9003)), owner=1)
    assert set(owners.tolist()) == {0}


def test_aware_baseline_runs_and_bypasses_dram_for_first_turns_it_does_not_expect_back():
    engine, summary = replay(session_trace(sessions=10), "tiered-aware")
    assert summary["hit_rate"] > 0
    assert summary["storage"].get("pages_not_admitted", 0) >= 0
    assert isinstance(engine.storage.dram, PredictedLru)


def comparison(rows):
    return {
        "summary": [
            {
                "system": system,
                "x": x,
                "seeds": 3,
                **{key: {"mean": value, "std": 0.0} for key, value in metrics.items()},
            }
            for system, x, metrics in rows
        ]
    }


def metrics(hit, ttft, p99):
    return {
        "hit_rate": hit,
        "ttft_mean_s": ttft,
        "ttft_p99_s": p99,
        "ssd_read_amplification": 1.1,
        "misplaced_rate": 0.01,
    }


def test_goal_compares_flatcake_with_the_best_other_system_per_cell():
    result = comparison(
        [
            ("flatcake", 1.0, metrics(0.997, 1.01, 5.0)),
            ("oracle", 1.0, metrics(1.0, 0.5, 2.0)),  # never the TTFT bar
            ("tiered", 1.0, metrics(0.7, 90.0, 400.0)),
            ("tiered-tuned", 1.0, metrics(1.0, 1.0, 5.5)),
            ("flatcake", 2.0, metrics(0.99, 1.0, 5.0)),
            ("tiered-tuned", 2.0, metrics(1.0, 0.9, 5.0)),
        ]
    )
    first, second = goal_rows("cell", result)
    assert first.best_hit.system == "oracle" and first.hit_ok  # 0.3 points off
    assert first.best_ttft.system == "tiered-tuned" and first.ttft_ok and first.p99_ok
    assert first.met and first.collapsed.mean == 0.7
    assert not second.hit_ok and not second.ttft_ok and second.p99_ok and not second.met
    table = goal_table([first, second])
    assert table.count("**no**") == 2 and "| cell | 1 |" in table
