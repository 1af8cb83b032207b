"""FC-MAS scheduler: dual queues, HRRN prefetch order, re-admission, budget, starvation, fcfs
baseline, stats and bad input (random runs are in ``test_scheduler_machines.py``)."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatcake_ray.core.gva import SSD_FLOOR, Medium
from flatcake_ray.core.scheduler import Phase, Scheduler, SchedulerConfig, response_ratio
from flatcake_ray.errors import (
    ClockError,
    ConfigError,
    DuplicateRequestError,
    InvalidRequestError,
    RequestStateError,
    UnknownRequestError,
)

DRAM_HIT = [7, 4096]
SSD_HIT = np.array([7, SSD_FLOOR + 4096], dtype=np.uint64)  # hybrid: DRAM prompt + SSD history


def ids(requests):
    return [r.request_id for r in requests]


def make(policy="fc-mas", inflight=1, window=None, limit=None):
    return Scheduler(SchedulerConfig(inflight, window, policy, limit))


# --- dual queues versus fcfs ---------------------------------------------------------------


def test_dram_hit_is_not_held_behind_an_ssd_restore():
    sched = make("fc-mas")
    sched.submit("ssd", 0.0, SSD_HIT, 10 << 30)
    assert ids(sched.start_prefetches(0.0)) == ["ssd"]
    sched.submit("dram", 1.0, DRAM_HIT, 0)
    assert ids(sched.pop_ready(1.0)) == ["dram"]
    sched.prefetch_done("ssd", 9.0)
    assert ids(sched.pop_ready(9.0)) == ["ssd"]


def test_fcfs_holds_a_dram_hit_behind_an_earlier_ssd_restore():
    sched = make("fcfs")
    sched.submit("ssd", 0.0, SSD_HIT, 10 << 30)
    assert ids(sched.start_prefetches(0.0)) == ["ssd"]
    sched.submit("dram", 1.0, DRAM_HIT, 0)
    assert sched.pop_ready(1.0, None) == []
    sched.prefetch_done("ssd", 9.0)
    assert ids(sched.pop_ready(9.0, None)) == ["ssd", "dram"]
    assert sched.stats().max_wait_dram == 8.0


def test_fcfs_starts_prefetches_in_arrival_order():
    sched = make("fcfs", inflight=1)
    for name, at, size in (("big", 0.0, 1000), ("small", 1.0, 1), ("tiny", 2.0, 1)):
        sched.submit(name, at, SSD_HIT, size)
    assert ids(sched.start_prefetches(2.0)) == ["big"]
    sched.prefetch_done("big", 50.0)
    assert ids(sched.start_prefetches(50.0)) == ["small"]


def test_no_hits_and_list_input_are_dram_ready():
    sched = make()
    assert sched.submit("empty", 0.0, [], 0).medium is Medium.DRAM
    assert sched.submit("arr", 0.0, np.array([], dtype=np.uint64), 0).medium is Medium.DRAM
    assert sched.submit("ssd", 0.0, [SSD_FLOOR], 5).medium is Medium.SSD
    assert sched.phase("empty") is Phase.READY and sched.phase("ssd") is Phase.WAITING


# --- HRRN order ------------------------------------------------------------------------------


def test_hrrn_hand_case():
    sched = make(inflight=1)
    sched.submit("x", 0.0, SSD_HIT, 100)
    assert ids(sched.start_prefetches(0.0)) == ["x"]
    sched.submit("a", 0.0, SSD_HIT, 1000)
    sched.submit("b", 5.0, SSD_HIT, 100)
    sched.submit("c", 8.0, SSD_HIT, 10)
    assert sched.start_prefetches(8.0) == []  # budget full: they wait
    # at t=10: a = 10/1000, b = 5/100, c = 2/10 -> c; at t=20: a = 0.02, b = 0.15 -> b
    assert sched.priority("c", 10.0) == pytest.approx(1.2)
    sched.prefetch_done("x", 10.0)
    assert ids(sched.start_prefetches(10.0)) == ["c"]
    sched.prefetch_done("c", 20.0)
    assert ids(sched.start_prefetches(20.0)) == ["b"]
    sched.prefetch_done("b", 30.0)
    assert ids(sched.start_prefetches(30.0)) == ["a"]


def test_hrrn_ages_an_older_larger_request_past_a_fresh_small_one():
    sched = make(inflight=1)
    sched.submit("x", 0.0, SSD_HIT, 1)
    sched.start_prefetches(0.0)
    sched.submit("old", 0.0, SSD_HIT, 100)  # at t=10: 10/100 = 0.1
    sched.submit("new", 9.5, SSD_HIT, 10)  # at t=10: 0.5/10 = 0.05
    sched.prefetch_done("x", 10.0)
    assert ids(sched.start_prefetches(10.0)) == ["old"]


def test_a_tie_goes_to_the_smaller_then_the_older_request():
    sched = make(inflight=1)
    sched.submit("x", 0.0, SSD_HIT, 1)
    sched.start_prefetches(0.0)
    sched.submit("big", 0.0, SSD_HIT, 20)  # at t=10: 10/20 = 0.5
    sched.submit("twin_a", 5.0, SSD_HIT, 10)  # 5/10 = 0.5, smaller: grows faster
    sched.submit("twin_b", 5.0, SSD_HIT, 10)
    sched.prefetch_done("x", 10.0)
    assert ids(sched.start_prefetches(10.0)) == ["twin_a"]


def test_zero_byte_ssd_request_counts_as_one_byte():
    assert response_ratio(4.0, 0) == response_ratio(4.0, 1) == 5.0
    sched = make(inflight=1)
    sched.submit("x", 0.0, SSD_HIT, 1)
    sched.start_prefetches(0.0)
    sched.submit("empty", 1.0, SSD_HIT, 0)
    sched.submit("one", 1.0, SSD_HIT, 2)
    sched.prefetch_done("x", 2.0)
    assert ids(sched.start_prefetches(2.0)) == ["empty"]


# --- re-admission ------------------------------------------------------------------------------


def test_prefetched_request_rejoins_by_original_arrival():
    sched = make(inflight=1)
    sched.submit("d0", 0.0, DRAM_HIT, 0)
    sched.submit("s1", 1.0, SSD_HIT, 100)
    sched.start_prefetches(1.0)
    sched.submit("d2", 2.0, DRAM_HIT, 0)
    sched.prefetch_done("s1", 3.0)
    sched.submit("d3", 3.0, DRAM_HIT, 0)
    assert ids(sched.pop_ready(3.0, 2)) == ["d0", "s1"]
    assert ids(sched.pop_ready(3.0, None)) == ["d2", "d3"]


# --- budget ------------------------------------------------------------------------------------


def test_byte_window_waits_without_backfill_and_an_oversize_request_starts_alone():
    sched = make(inflight=4, window=100)
    sched.submit("a", 0.0, SSD_HIT, 60)
    assert ids(sched.start_prefetches(0.0)) == ["a"]
    sched.submit("b", 1.0, SSD_HIT, 50)
    sched.submit("c", 1.5, SSD_HIT, 30)  # would fit, but b is ahead (0.5/30 < 1/50 at t=2)
    assert sched.start_prefetches(2.0) == []
    sched.submit("huge", 2.0, SSD_HIT, 500)
    sched.prefetch_done("a", 3.0)
    assert ids(sched.start_prefetches(3.0)) == ["c", "b"]  # now 1.5/30 > 2/50
    sched.prefetch_done("b", 4.0)
    sched.prefetch_done("c", 4.0)
    assert ids(sched.start_prefetches(4.0)) == ["huge"]
    assert sched.stats().inflight_bytes == 500


def test_cancel_frees_budget_in_every_phase():
    sched = make(inflight=1)
    sched.submit("a", 0.0, SSD_HIT, 10)
    sched.submit("b", 0.0, SSD_HIT, 10)
    sched.submit("d", 0.0, DRAM_HIT, 0)
    assert ids(sched.start_prefetches(0.0)) == ["a"]
    assert sched.cancel("a", 1.0) is Phase.PREFETCHING
    assert ids(sched.start_prefetches(1.0)) == ["b"]
    assert sched.cancel("d", 1.0) is Phase.READY
    sched.submit("c", 1.0, SSD_HIT, 10)
    assert sched.cancel("c", 1.0) is Phase.WAITING
    assert sched.pop_ready(1.0, None) == []
    stats = sched.stats()
    assert (stats.cancelled, stats.inflight_prefetches, stats.ready) == (3, 1, 0)
    with pytest.raises(UnknownRequestError):
        sched.prefetch_done("a", 2.0)  # the caller stopped that I/O


def test_ids_are_reusable_once_gone():
    for policy in ("fc-mas", "fcfs"):
        sched = make(policy)
        sched.submit("r", 0.0, DRAM_HIT, 0)
        sched.cancel("r", 0.0)
        sched.submit("r", 1.0, DRAM_HIT, 0)
        assert [r.arrival for r in sched.pop_ready(1.0, None)] == [1.0]
        sched.submit("r", 2.0, DRAM_HIT, 0)
        assert len(sched) == 1 and "r" in sched


# --- starvation ----------------------------------------------------------------------------------


def overload(limit):
    """Budget 1; a large restore waits behind an overload of small ones (2 arrive per second,
    each takes 1 s). Returns when the large one started, or None if not by t=200."""
    sched = make(inflight=1, limit=limit)
    sched.submit("busy", 0.0, SSD_HIT, 1)
    sched.start_prefetches(0.0)
    sched.submit("large", 0.0, SSD_HIT, 1000)
    running, done_at = "busy", 1.0
    for step in range(1, 400):
        now = step * 0.5
        if now == done_at:
            sched.prefetch_done(running, now)
            sched.pop_ready(now, None)
        sched.submit(step, now, SSD_HIT, 1)
        for request in sched.start_prefetches(now):
            if request.request_id == "large":
                return now
            running, done_at = request.request_id, now + 1.0
    return None


def test_pure_hrrn_can_starve_under_overload_and_the_limit_bounds_it():
    assert overload(limit=None) is None
    assert overload(limit=10.0) == 10.0


def simulate(sched, arrivals):
    """Drive ``sched`` with ``arrivals`` [(time, id, ssd, kv_bytes, duration)] until it drains;
    at every start check the choice against Eq. 1. Returns {id: start}, {id: dispatch}."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    facts = {a[1]: a for a in arrivals}
    waiting, completions, started, dispatched = set(), [], {}, {}
    index = 0
    while index < len(arrivals) or completions:
        next_arrival = arrivals[index][0] if index < len(arrivals) else math.inf
        now = min(next_arrival, completions[0][0] if completions else math.inf)
        while completions and completions[0][0] == now:
            sched.prefetch_done(heapq.heappop(completions)[-1], now)
        while index < len(arrivals) and arrivals[index][0] == now:
            at, rid, ssd, size, _ = arrivals[index]
            sched.submit(rid, at, SSD_HIT if ssd else DRAM_HIT, size if ssd else 0)
            waiting.update([rid] if ssd else [])
            index += 1
        for request in sched.start_prefetches(now):
            if sched.config.starvation_limit is None:
                best = max((now - facts[w][0]) / max(facts[w][3], 1) for w in waiting)
                assert (now - request.arrival) / max(request.kv_bytes, 1) == best
            waiting.remove(request.request_id)
            assert request.request_id not in started
            started[request.request_id] = now
            # the start count breaks ties, so ids of mixed types are never compared
            finish = now + facts[request.request_id][4]
            heapq.heappush(completions, (finish, len(started), request.request_id))
        for request in sched.pop_ready(now, None):
            assert request.request_id not in dispatched
            dispatched[request.request_id] = now
    return started, dispatched


small_stream = st.lists(
    st.tuples(
        st.integers(0, 400).map(lambda t: t / 4),  # arrival, exact in binary
        st.booleans(),  # touches SSD
        st.integers(0, 64),  # SSD bytes
        st.integers(1, 20).map(lambda d: d / 4),  # prefetch duration
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(stream=small_stream, large_at=st.integers(0, 400), inflight=st.integers(1, 3))
def test_a_large_request_is_started_and_everything_dispatched_once(stream, large_at, inflight):
    arrivals = [(t, i, ssd, size, d) for i, (t, ssd, size, d) in enumerate(stream)]
    arrivals.append((large_at / 4, "large", True, 1 << 30, 5.0))
    started, dispatched = simulate(make(inflight=inflight), arrivals)
    assert "large" in started
    assert sorted(dispatched, key=str) == sorted((a[1] for a in arrivals), key=str)


@settings(max_examples=100, deadline=None)
@given(stream=small_stream, limit=st.integers(0, 40).map(lambda t: t / 4))
def test_starvation_limit_bounds_the_wait_of_a_large_request(stream, limit):
    # The large one arrives first, so no other request reaches the limit before it does; it
    # starts by the limit plus the longest small prefetch then in flight.
    arrivals = [(0.0, "large", True, 1 << 30, 5.0)]  # first among equal times: lowest seq
    arrivals += [(t, i, ssd, size, d) for i, (t, ssd, size, d) in enumerate(stream)]
    started, _ = simulate(make(inflight=1, limit=limit), arrivals)
    assert started["large"] <= limit + 5.0


# --- stats and bad input -------------------------------------------------------------------------


def test_stats_count_queues_dispatches_and_waits():
    sched = make(inflight=2)
    sched.submit("d", 0.0, DRAM_HIT, 0)
    sched.submit("s", 0.0, SSD_HIT, 40)
    sched.submit("t", 1.0, SSD_HIT, 60)
    before = sched.stats()
    assert (before.ready, before.waiting_prefetch, before.inflight_prefetches) == (1, 2, 0)
    sched.start_prefetches(2.0)
    sched.prefetch_done("s", 3.0)
    sched.prefetch_done("t", 5.0)
    sched.pop_ready(6.0, None)
    stats = sched.stats()
    assert (stats.dispatched_dram, stats.dispatched_ssd, stats.ready) == (1, 2, 0)
    assert (stats.max_inflight_prefetches_seen, stats.max_inflight_bytes_seen) == (2, 100)
    assert (stats.prefetches_started, stats.prefetches_completed) == (2, 2)
    assert (stats.mean_wait_ssd, stats.max_wait_ssd, stats.max_wait_dram) == (5.5, 6.0, 6.0)
    assert (stats.mean_prefetch_queue_wait, stats.max_prefetch_queue_wait) == (1.5, 2.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_inflight_prefetches": 0},
        {"max_inflight_prefetches": 1.5},
        {"max_inflight_prefetches": True},
        {"max_inflight_bytes": 0},
        {"policy": "lifo"},
        {"starvation_limit": -1.0},
        {"starvation_limit": math.inf},
    ],
)
def test_bad_config_is_rejected(kwargs):
    with pytest.raises(ConfigError):
        SchedulerConfig(**kwargs)
    assert issubclass(ConfigError, ValueError)


def test_bad_calls_raise_typed_errors_and_change_nothing():
    sched = make()
    sched.submit("a", 5.0, SSD_HIT, 10)
    bad_calls = [
        (DuplicateRequestError, lambda: sched.submit("a", 6.0, SSD_HIT, 10)),
        (ClockError, lambda: sched.submit("b", 4.0, SSD_HIT, 10)),
        (ClockError, lambda: sched.pop_ready(math.nan)),
        (ClockError, lambda: sched.start_prefetches("7")),
        (InvalidRequestError, lambda: sched.submit("b", 6.0, SSD_HIT, -1)),
        (InvalidRequestError, lambda: sched.submit("b", 6.0, SSD_HIT, 1.5)),
        (InvalidRequestError, lambda: sched.submit("b", 6.0, DRAM_HIT, 10)),
        (InvalidRequestError, lambda: sched.submit("b", 6.0, [-1], 0)),
        (InvalidRequestError, lambda: sched.pop_ready(6.0, 0)),
        (UnknownRequestError, lambda: sched.cancel("nope", 6.0)),
        (UnknownRequestError, lambda: sched.phase("nope")),
        (RequestStateError, lambda: sched.prefetch_done("a", 6.0)),
    ]
    for error, call in bad_calls:
        with pytest.raises(error):
            call()
    assert len(sched) == 1 and sched.phase("a") is Phase.WAITING
    assert ids(sched.start_prefetches(5.0)) == ["a"]  # the clock never moved past 5.0
