"""FC-MAS shared-prefix holds: a prefetch of SSD pages that an earlier unfinished request
will bring into HBM waits for that request's prefill, then reads only what is still needed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flatcake_ray.core.gva import SSD_FLOOR
from flatcake_ray.core.scheduler import Phase, Scheduler, SchedulerConfig
from flatcake_ray.errors import ConfigError, RequestStateError

PAGE = 4096


def gvas(*pages):
    return np.array([SSD_FLOOR + p * PAGE for p in pages], dtype=np.uint64)


def ids(requests):
    return [r.request_id for r in requests]


def make(hold=True, policy="fc-mas", inflight=4):
    return Scheduler(SchedulerConfig(inflight, None, policy, hold_shared_prefixes=hold))


@pytest.mark.parametrize("policy", ["fc-mas", "fcfs"])
def test_a_next_turn_waits_for_the_turn_that_brings_its_prefix(policy):
    sched = make(policy=policy)
    sched.submit("turn1", 0.0, gvas(0, 1), 2 * PAGE)
    sched.submit("turn2", 0.1, gvas(0, 1, 2), 3 * PAGE)
    assert ids(sched.start_prefetches(0.1)) == ["turn1"]
    assert sched.phase("turn2") is Phase.HELD
    sched.prefetch_done("turn1", 1.0)
    assert ids(sched.pop_ready(1.0)) == ["turn1"]
    assert sched.start_prefetches(1.5) == [] and sched.take_released() == []  # still running
    sched.finished("turn1", 2.0)
    assert ids(sched.take_released()) == ["turn2"]
    sched.update("turn2", 2.0, gvas(2), PAGE)  # pages 0-1 are in HBM now
    [started] = sched.start_prefetches(2.0)
    assert (started.request_id, started.kv_bytes, started.arrival) == ("turn2", PAGE, 0.1)
    stats = sched.stats()
    assert (stats.holds, stats.released, stats.held) == (1, 1, 0)


def test_without_holds_both_turns_read_the_shared_prefix():
    sched = make(hold=False)
    sched.submit("turn1", 0.0, gvas(0, 1), 2 * PAGE)
    sched.submit("turn2", 0.1, gvas(0, 1, 2), 3 * PAGE)
    assert ids(sched.start_prefetches(0.1)) == ["turn1", "turn2"]


def test_a_released_request_with_nothing_left_to_read_is_ready_at_once():
    sched = make()
    sched.submit("a", 0.0, gvas(0), PAGE)
    sched.submit("b", 0.0, gvas(0), PAGE)
    sched.start_prefetches(0.0)
    sched.prefetch_done("a", 1.0)
    sched.pop_ready(1.0)
    sched.finished("a", 2.0)
    sched.take_released()
    sched.update("b", 2.0, gvas(), 0)
    assert sched.phase("b") is Phase.READY and ids(sched.pop_ready(2.0)) == ["b"]


def test_a_request_sent_back_keeps_its_holds_and_cancel_releases_them():
    sched = make()
    sched.submit("a", 0.0, gvas(0, 1), 2 * PAGE)
    sched.start_prefetches(0.0)
    sched.prefetch_done("a", 1.0)
    sched.pop_ready(1.0)
    sched.submit("b", 1.0, gvas(1), PAGE)
    assert sched.phase("b") is Phase.HELD
    sched.submit("a", 1.5, gvas(0, 1, 5), 3 * PAGE)  # sent back before it ran: still older
    assert sched.phase("b") is Phase.HELD
    assert ids(sched.start_prefetches(1.5)) == ["a"]
    sched.cancel("a", 2.0)
    assert ids(sched.take_released()) == ["b"] and sched.phase("b") is Phase.WAITING


def test_hold_errors_are_typed():
    with pytest.raises(ConfigError):
        SchedulerConfig(hold_shared_prefixes=1)  # type: ignore[arg-type]
    sched = make()
    sched.submit("a", 0.0, gvas(0), PAGE)
    sched.submit("b", 0.0, gvas(0), PAGE)
    with pytest.raises(RequestStateError):
        sched.update("b", 0.0, gvas(), 0)  # held: its holder has not finished
    with pytest.raises(RequestStateError):
        sched.finished("a", 0.0)  # not dispatched


class HoldMachine(RuleBasedStateMachine):
    """A caller with an HBM that only grows: a request's pages enter it when its prefill ends.
    Every page a request reads from SSD must still be missing from HBM when it runs (read,
    then found in HBM, is the waste the holds remove), and every request must get done."""

    policy = "fc-mas"

    def __init__(self):
        super().__init__()
        self.sched = make(policy=self.policy, inflight=2)
        self.now, self.next_id = 0.0, 0
        self.hbm: set[int] = set()
        self.pages: dict[int, frozenset[int]] = {}
        self.read: dict[int, set[int]] = {}
        self.wants: dict[int, set[int]] = {}  # what its current submission must read
        self.inflight: set[int] = set()
        self.running: list[int] = []
        self.done: set[int] = set()

    def _todo(self, rid):
        return sorted(self.pages[rid] - self.hbm - self.read[rid])

    @rule(pages=st.frozensets(st.integers(0, 7), max_size=4), dt=st.integers(0, 3))
    def submit(self, pages, dt):
        self.now += dt / 4
        rid = self.next_id
        self.next_id += 1
        self.pages[rid], self.read[rid] = pages, set()
        self._submit(rid)

    def _submit(self, rid):
        todo = self._todo(rid)
        self.wants[rid] = set(todo)
        self.sched.submit(rid, self.now, gvas(*todo), len(todo) * PAGE)

    @rule()
    def start(self):
        for request in self.sched.start_prefetches(self.now):
            rid = request.request_id
            assert not self.wants[rid] & self.hbm
            self.read[rid] |= self.wants[rid]
            self.inflight.add(rid)

    @precondition(lambda self: self.inflight)
    @rule(data=st.data())
    def complete(self, data):
        rid = data.draw(st.sampled_from(sorted(self.inflight)))
        self.inflight.remove(rid)
        self.sched.prefetch_done(rid, self.now)

    @rule()
    def dispatch(self):
        for request in self.sched.pop_ready(self.now, None):
            rid = request.request_id
            assert not self.read[rid] & self.hbm, "read from SSD what HBM holds by now"
            self.running.append(rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), back=st.booleans())
    def finish(self, data, back):
        rid = data.draw(st.sampled_from(self.running))
        self.running.remove(rid)
        if back and self._todo(rid):  # sent back for a prefetch of what it lacks
            self._submit(rid)
            return
        self.hbm |= self.pages[rid]
        self.done.add(rid)
        self.sched.finished(rid, self.now)
        for request in self.sched.take_released():
            self._submit_update(request.request_id)

    def _submit_update(self, rid):
        todo = self._todo(rid)
        self.wants[rid] = set(todo)
        self.sched.update(rid, self.now, gvas(*todo), len(todo) * PAGE)

    @invariant()
    def held_requests_wait_for_someone(self):
        assert self.sched.stats().held <= len(self.sched)

    def teardown(self):
        for _ in range(4 * self.next_id + 1):
            if len(self.done) == self.next_id:
                break
            self.start()
            for rid in sorted(self.inflight):
                self.complete_one(rid)
            self.dispatch()
            while self.running:
                rid = self.running.pop(0)
                self.hbm |= self.pages[rid]
                self.done.add(rid)
                self.sched.finished(rid, self.now)
                for request in self.sched.take_released():
                    self._submit_update(request.request_id)
        assert len(self.done) == self.next_id and len(self.sched) == 0  # no request stuck

    def complete_one(self, rid):
        self.inflight.remove(rid)
        self.sched.prefetch_done(rid, self.now)


class FcfsHoldMachine(HoldMachine):
    policy = "fcfs"


TestHoldMachine = HoldMachine.TestCase
TestHoldMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestFcfsHoldMachine = FcfsHoldMachine.TestCase
TestFcfsHoldMachine.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)


def test_a_finished_holders_pages_pass_to_the_oldest_request_still_bringing_them():
    """b finds page 0 in DRAM (it reads nothing) while a, older, holds it; when a finishes,
    b holds page 0, so c, which must read it from SSD, waits for b's prefill."""
    sched = make()
    dram_page0 = np.array([4096], dtype=np.uint64)
    sched.submit("a", 0.0, gvas(0), PAGE, pages=["p0"])
    sched.submit("b", 0.0, dram_page0, 0, pages=["p0"])
    sched.start_prefetches(0.0)
    sched.prefetch_done("a", 1.0)
    assert ids(sched.pop_ready(1.0, None)) == ["a", "b"]
    sched.finished("a", 2.0)
    sched.submit("c", 2.0, gvas(0), PAGE, pages=["p0"])
    assert sched.phase("c") is Phase.HELD
    sched.finished("b", 3.0)
    assert ids(sched.take_released()) == ["c"]


def test_pages_a_prefill_computes_hold_too():
    sched = make()
    sched.submit("turn1", 0.0, gvas(), 0, pages=[], computes=["p5"])  # computes page 5
    sched.submit("turn2", 0.5, gvas(5), PAGE, pages=["p5"])  # stored meanwhile, on SSD
    assert sched.phase("turn2") is Phase.HELD
