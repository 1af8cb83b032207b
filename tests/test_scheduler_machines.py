"""FC-MAS scheduler under random arrivals, completions and cancellations (hypothesis state
machines): every request dispatched once, budgets and the starvation limit hold."""

from __future__ import annotations

import math

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flatcake_ray.core.scheduler import Phase, Scheduler, SchedulerConfig
from tests.test_scheduler import DRAM_HIT, SSD_HIT, ids

# --- random arrivals, completions and cancellations --------------------------------------------


class SchedulerMachine(RuleBasedStateMachine):
    """The caller's view: what it started is in flight until it completes or cancels it."""

    config = SchedulerConfig(max_inflight_prefetches=3, max_inflight_bytes=100, policy="fc-mas")

    def __init__(self):
        super().__init__()
        self.sched = Scheduler(self.config)
        self.now, self.next_id = 0.0, 0
        self.live, self.inflight, self.started = set(), {}, set()
        self.gone: list[int] = []  # dispatched or cancelled
        self.dispatched: list[int] = []

    @rule(dt=st.integers(0, 8), ssd=st.booleans(), size=st.integers(0, 150))
    def submit(self, dt, ssd, size):
        self.now += dt / 4
        self.sched.submit(self.next_id, self.now, SSD_HIT if ssd else DRAM_HIT, size * ssd)
        self.live.add(self.next_id)
        self.next_id += 1

    @rule()
    def start(self):
        for request in self.sched.start_prefetches(self.now):
            assert request.request_id not in self.started  # each prefetch runs once
            self.started.add(request.request_id)
            self.inflight[request.request_id] = request.kv_bytes

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), dt=st.integers(0, 8))
    def complete(self, data, dt):
        self.now += dt / 4
        rid = data.draw(st.sampled_from(sorted(self.inflight)))
        self.sched.prefetch_done(rid, self.now)
        del self.inflight[rid]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.sched.cancel(rid, self.now)
        self.inflight.pop(rid, None)
        self.live.remove(rid)
        self.gone.append(rid)

    @rule(max_n=st.one_of(st.none(), st.integers(1, 4)))
    def pop(self, max_n):
        taken = ids(self.sched.pop_ready(self.now, max_n))
        assert taken == sorted(taken)  # ids are handed out in arrival order
        assert not self.inflight.keys() & set(taken)
        self.live.difference_update(taken)
        self.gone.extend(taken)
        self.dispatched.extend(taken)

    @invariant()
    def budget_is_kept_and_nothing_is_revoked(self):
        stats = self.sched.stats()
        assert (
            stats.inflight_prefetches == len(self.inflight) <= self.config.max_inflight_prefetches
        )
        assert stats.inflight_bytes == sum(self.inflight.values())
        window = self.config.max_inflight_bytes or math.inf
        assert stats.inflight_bytes <= window or len(self.inflight) == 1
        assert all(self.sched.phase(rid) is Phase.PREFETCHING for rid in self.inflight)
        assert len(self.sched) == len(self.live)

    def teardown(self):
        for _ in range(len(self.live)):  # each round dispatches at least the oldest request
            self.start()
            for rid in sorted(self.inflight):
                self.sched.prefetch_done(rid, self.now)
            self.inflight.clear()
            self.pop(None)
        assert not self.live and sorted(self.gone) == list(range(self.next_id))


class FcfsMachine(SchedulerMachine):
    config = SchedulerConfig(max_inflight_prefetches=2, max_inflight_bytes=80, policy="fcfs")

    @invariant()
    def dispatch_follows_arrival(self):
        assert self.dispatched == sorted(self.dispatched)


class StarvationLimitMachine(SchedulerMachine):
    config = SchedulerConfig(3, 100, "fc-mas", starvation_limit=1.0)


TestFcMasMachine = SchedulerMachine.TestCase
TestFcMasMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestFcfsMachine = FcfsMachine.TestCase
TestFcfsMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestStarvationLimitMachine = StarvationLimitMachine.TestCase
TestStarvationLimitMachine.settings = TestFcfsMachine.settings
