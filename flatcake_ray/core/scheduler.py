"""FC-MAS: the medium-aware dual-queue request scheduler (paper section 3.3).

A pure state machine (no I/O, no threads, no clock of its own) driven by the live client
(wall clock, prefetches run by the restore pipeline) and by the trace-replay model (virtual
clock, modelled prefetch durations).

Contract. The caller serialises calls. Every ``now`` (``arrival`` included: it is stamped at
submission) is the caller's clock in seconds and never goes backwards, else ``ClockError``.

1. ``submit(request_id, arrival, gvas, kv_bytes)`` once the prefix hits are resolved. With no
   SSD GVA the request is ready at once; one that touches SSD waits for its prefetch, and the
   caller keeps its DRAM pages pinned until it is dispatched or cancelled.
2. ``start_prefetches(now)`` after every submit, ``prefetch_done`` and ``cancel``: the SSD
   requests whose prefetch the caller must start now; they hold budget until reported.
3. ``prefetch_done(request_id, now)`` once a started prefetch's data is in: it becomes ready.
4. ``pop_ready(now, max_n)`` when the engine takes work: ready requests, oldest arrival first.
   A dispatched request leaves the scheduler; its id may be submitted again.
5. ``cancel(request_id, now)`` at any point before dispatch. If its prefetch is in flight the
   caller stops that I/O first and does not report it done; its budget is freed at once.

With ``hold_shared_prefixes`` (``prefix_holds.py`` states the rule) a request whose SSD pages
an earlier, unfinished request will bring into HBM is HELD until that one's prefill ends
(``submit``'s ``pages`` name the pages; else their GVAs do). Two more calls then apply:

6. ``finished(request_id, now)`` once a dispatched request's prefill has ended (or it was
   dropped): it brings nothing more into HBM. A dispatched id stays known until then; if
   the caller submits it again before, it goes back (it did not run) and keeps its holds.
7. ``take_released()`` after ``finished`` and ``cancel``: the requests whose hold ended
   (oldest first), back among the waiting. For each, look storage up again and call
   ``update(request_id, now, gvas, kv_bytes)`` with what it must still read: with no SSD
   GVA left it is ready at once, else it waits for a prefetch of the rest.

A started prefetch is never revoked: when the budget is full, unstarted prefetches wait.

Policies. ``"fc-mas"``: DRAM-ready requests go to a ready heap keyed by arrival and dispatch
at once; SSD prefetches start in highest-response-ratio order, ``1 + wait / kv_bytes`` (wait in
seconds, kv_bytes in bytes; the order does not depend on the units), and a prefetched request
joins the ready heap by its original arrival, ahead of DRAM hits that came after it.
``"fcfs"`` (the paper's w/o-FC-MAS ablation): one line in arrival order, prefetches started in
that order under the same budget, and no dispatch past a head whose SSD data is not in.

Budget: at most ``max_inflight_prefetches`` and, if set, ``max_inflight_bytes`` in flight; one
request larger than the byte budget starts alone. Starts follow the priority order strictly
(no backfill), so small requests that happen to fit cannot pass a large one for ever.

Starvation. The wait term grows linearly, so under a stable load a large request starts at the
first free slot once its ratio tops the rest. Under sustained overload pure HRRN can starve it:
a request of size s that arrived at a2 > a out-ranks one of size S from a while
(t - a2) / s > (t - a) / S, and the backlog of such requests can grow without end.
``starvation_limit`` bounds this: a request that has waited that long starts before any later
one (oldest first). ``None`` keeps the paper's pure HRRN.

Complexity. HRRN order changes with time (two ratios can cross), so no heap on a fixed key holds
it. Waiting SSD requests sit in numpy arrays with swap-remove: submit, cancel and prefetch_done
are O(1) (plus an O(log R) heap push for R ready); choosing a prefetch is one vectorised O(W)
pass over the W waiting (tens of microseconds at W = 1000); pop_ready is O(log R) per
request. fcfs is O(1) throughout (O(W) for a request that a hold released). Holds cost a
dict operation per SSD page at submit and at finish. The queues are in
``scheduler_queues.py``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np

from flatcake_ray.core.gva import SSD_FLOOR, Medium
from flatcake_ray.core.prefix_holds import PrefixHolds
from flatcake_ray.core.scheduler_queues import (
    FcfsLine,
    FifoPool,
    HrrnPool,
    LiveRequest,
    ReadyHeap,
    WaitStat,
)
from flatcake_ray.core.scheduler_types import (
    POLICIES,
    Phase,
    RequestId,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerStats,
    checked_request,
    is_int,
    is_real,
    response_ratio,
)
from flatcake_ray.errors import (
    ClockError,
    DuplicateRequestError,
    InvalidRequestError,
    RequestStateError,
    UnknownRequestError,
)
from flatcake_ray.failpoints import failpoint

__all__ = [
    "POLICIES",
    "Phase",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "response_ratio",
]


class Scheduler:
    """FC-MAS (or its fcfs baseline) for one engine; see the module docstring for the contract."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self._live: dict[RequestId, LiveRequest] = {}
        fcmas = self.config.policy == "fc-mas"
        self._waiting = HrrnPool(self.config.starvation_limit) if fcmas else FifoPool()
        self._ready = ReadyHeap(self._live) if fcmas else FcfsLine(self._live)
        self._holds = PrefixHolds() if self.config.hold_shared_prefixes else None
        self._running: set[RequestId] = set()  # dispatched, not yet finished (holds only)
        self._released: list[ScheduledRequest] = []
        self._clock = -math.inf
        self._next_seq = 0
        self._ready_count = 0
        self._inflight_count = 0
        self._inflight_bytes = 0
        self._max_inflight_count = 0
        self._max_inflight_bytes = 0
        self._started = self._completed = self._cancelled = 0
        self._hold_count = self._release_count = 0
        self._waits = {Medium.DRAM: WaitStat(), Medium.SSD: WaitStat()}
        self._queue_wait = WaitStat()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def submit(
        self,
        request_id: RequestId,
        arrival: float,
        gvas: np.ndarray | Sequence[int],
        kv_bytes: int,
        pages: np.ndarray | Sequence[Hashable] | None = None,
        computes: np.ndarray | Sequence[Hashable] = (),
    ) -> ScheduledRequest:
        """Classify a new request by its slowest medium and queue it. For the holds:
        ``pages`` name the pages of ``gvas`` (one each; None: the GVAs name them) and
        ``computes`` the pages its prefill computes (in HBM after it too)."""
        arrival = self._checked_time(arrival)
        if request_id in self._live:
            raise DuplicateRequestError(f"request {request_id!r} is already queued")
        request = checked_request(request_id, arrival, gvas, kv_bytes, pages)
        self._clock = arrival
        self._running.discard(request_id)  # submitted again before it ran: it did not run
        live = LiveRequest(request, Phase.WAITING, self._next_seq)
        self._next_seq += 1
        self._live[request_id] = live
        self._ready.enlist_new(live)
        self._queue(live, gvas, pages, computes)
        return live.request

    def update(
        self,
        request_id: RequestId,
        now: float,
        gvas: np.ndarray | Sequence[int],
        kv_bytes: int,
        pages: np.ndarray | Sequence[Hashable] | None = None,
    ) -> ScheduledRequest:
        """A waiting request was looked up again (after a hold): what it must still read. It
        keeps its arrival and place (and the pages it holds); with no SSD GVA left it is ready
        at once."""
        now = self._checked_time(now)
        live = self._get(request_id)
        if live.phase is not Phase.WAITING:
            raise RequestStateError(f"request {request_id!r} is {live.phase.value}, not waiting")
        request = checked_request(request_id, live.request.arrival, gvas, kv_bytes, pages)
        self._clock = now
        self._waiting.remove(request_id)
        live.request = request
        self._queue(live, gvas, pages, ())
        return request

    def start_prefetches(self, now: float) -> list[ScheduledRequest]:
        """Move waiting SSD requests into flight while the budget allows; the caller starts them."""
        failpoint("scheduler.start_prefetches")
        self._clock = now = self._checked_time(now)
        started: list[ScheduledRequest] = []
        while self._inflight_count < self.config.max_inflight_prefetches:
            request_id = self._waiting.peek(now)
            if request_id is None:
                break
            live = self._live[request_id]
            if not self._fits(live.request.kv_bytes):
                break  # no backfill: the next in order keeps its place until it fits
            self._waiting.remove(request_id)
            self._begin_prefetch(live, now)
            started.append(live.request)
        return started

    def prefetch_done(self, request_id: RequestId, now: float) -> None:
        """A started prefetch's data is in: free its budget and make the request ready."""
        failpoint("scheduler.prefetch_done", request_id=request_id)
        now = self._checked_time(now)
        live = self._get(request_id)
        if live.phase is not Phase.PREFETCHING:
            raise RequestStateError(
                f"request {request_id!r} is {live.phase.value}, not prefetching"
            )
        self._clock = now
        self._end_prefetch(live)
        self._completed += 1
        self._make_ready(live)

    def pop_ready(self, now: float, max_n: int | None = 1) -> list[ScheduledRequest]:
        """Dispatch up to ``max_n`` (None: all) ready requests, oldest arrival first."""
        now = self._checked_time(now)
        if max_n is not None and (not is_int(max_n) or max_n < 1):
            raise InvalidRequestError(f"max_n must be None or an integer >= 1, not {max_n!r}")
        self._clock = now
        taken = self._ready.pop(len(self._live) if max_n is None else max_n)
        for live in taken:
            request_id = live.request.request_id
            del self._live[request_id]
            self._ready_count -= 1
            self._waits[live.request.medium].add(now - live.request.arrival)
            if self._holds is not None and request_id in self._holds:
                self._running.add(request_id)  # it holds pages until its prefill ends
        return [live.request for live in taken]

    def finished(self, request_id: RequestId, now: float) -> None:
        """A dispatched request's prefill has ended: release what waited for it."""
        now = self._checked_time(now)
        if request_id in self._live:
            raise RequestStateError(f"request {request_id!r} was not dispatched")
        self._clock = now
        if request_id in self._running:
            self._running.discard(request_id)
            self._release(request_id)

    def take_released(self) -> list[ScheduledRequest]:
        """The requests whose hold ended since the last call, oldest first (now waiting)."""
        released, self._released = self._released, []
        return [r for r in released if self._is_waiting(r)]

    def cancel(self, request_id: RequestId, now: float) -> Phase:
        """Forget a request not yet dispatched; returns the phase it was in."""
        now = self._checked_time(now)
        live = self._get(request_id)
        self._clock = now
        if live.phase is Phase.WAITING:
            self._waiting.remove(request_id)
        elif live.phase is Phase.PREFETCHING:
            self._end_prefetch(live)
        elif live.phase is Phase.READY:
            self._ready_count -= 1
        self._ready.discard(live)
        del self._live[request_id]
        self._cancelled += 1
        self._release(request_id)
        return live.phase

    def phase(self, request_id: RequestId) -> Phase:
        return self._get(request_id).phase

    def priority(self, request_id: RequestId, now: float) -> float:
        """Eq. 1 for a live request at ``now`` (read only; does not advance the clock)."""
        request = self._get(request_id).request
        return response_ratio(now - request.arrival, request.kv_bytes)

    def stats(self) -> SchedulerStats:
        dram, ssd = self._waits[Medium.DRAM], self._waits[Medium.SSD]
        return SchedulerStats(
            ready=self._ready_count,
            waiting_prefetch=len(self._waiting),
            inflight_prefetches=self._inflight_count,
            inflight_bytes=self._inflight_bytes,
            max_inflight_prefetches_seen=self._max_inflight_count,
            max_inflight_bytes_seen=self._max_inflight_bytes,
            prefetches_started=self._started,
            prefetches_completed=self._completed,
            dispatched_dram=dram.count,
            dispatched_ssd=ssd.count,
            cancelled=self._cancelled,
            mean_wait_dram=dram.mean,
            max_wait_dram=dram.max,
            mean_wait_ssd=ssd.mean,
            max_wait_ssd=ssd.max,
            mean_prefetch_queue_wait=self._queue_wait.mean,
            max_prefetch_queue_wait=self._queue_wait.max,
            held=0 if self._holds is None else self._holds.held_count,
            holds=self._hold_count,
            released=self._release_count,
        )

    def _queue(
        self,
        live: LiveRequest,
        gvas: np.ndarray | Sequence[int],
        pages: np.ndarray | Sequence[Hashable] | None,
        computes: np.ndarray | Sequence[Hashable],
    ) -> None:
        """Place a submitted or updated request: ready, held, or waiting for a prefetch."""
        held = False
        if self._holds is not None:
            brings, reads = _hold_pages(gvas, pages)
            brings += np.asarray(computes).tolist()
            held = self._holds.register(live.request.request_id, brings, reads)
        if live.request.medium is Medium.DRAM:
            self._make_ready(live)
        elif held:
            live.phase = Phase.HELD
            self._hold_count += 1
        else:
            live.phase = Phase.WAITING
            self._waiting.add(live)

    def _make_ready(self, live: LiveRequest) -> None:
        live.phase = Phase.READY
        self._ready_count += 1
        self._ready.admit(live)

    def _release(self, request_id: RequestId) -> None:
        if self._holds is None:
            return
        for waiter in self._holds.drop(request_id):
            live = self._live[waiter]
            live.phase = Phase.WAITING
            self._waiting.add(live)
            self._released.append(live.request)
            self._release_count += 1

    def _is_waiting(self, request: ScheduledRequest) -> bool:
        live = self._live.get(request.request_id)
        return live is not None and live.request is request and live.phase is Phase.WAITING

    def _checked_time(self, now: float) -> float:
        # Only checked here; each call commits it once all its checks passed, so a rejected
        # call leaves the scheduler exactly as it was.
        if not is_real(now) or not math.isfinite(now):
            raise ClockError(f"time must be a finite number, not {now!r}")
        if now < self._clock:
            raise ClockError(f"time went backwards: {now!r} after {self._clock!r}")
        return float(now)

    def _get(self, request_id: RequestId) -> LiveRequest:
        live = self._live.get(request_id)
        if live is None:
            raise UnknownRequestError(f"request {request_id!r} is not queued")
        return live

    def _fits(self, kv_bytes: int) -> bool:
        window = self.config.max_inflight_bytes
        if window is None or self._inflight_count == 0:
            return True  # an oversize request starts alone rather than never
        return self._inflight_bytes + kv_bytes <= window

    def _begin_prefetch(self, live: LiveRequest, now: float) -> None:
        live.phase = Phase.PREFETCHING
        self._inflight_count += 1
        self._inflight_bytes += live.request.kv_bytes
        self._max_inflight_count = max(self._max_inflight_count, self._inflight_count)
        self._max_inflight_bytes = max(self._max_inflight_bytes, self._inflight_bytes)
        self._started += 1
        self._queue_wait.add(now - live.request.arrival)

    def _end_prefetch(self, live: LiveRequest) -> None:
        self._inflight_count -= 1
        self._inflight_bytes -= live.request.kv_bytes


def _hold_pages(
    gvas: np.ndarray | Sequence[int], pages: np.ndarray | Sequence[Hashable] | None
) -> tuple[list[Hashable], list[Hashable]]:
    """(every page the request brings into HBM, the pages it reads from SSD), by name."""
    values = np.asarray(gvas, dtype=np.uint64)
    names = values if pages is None else np.asarray(pages)
    return names.tolist(), names[values >= SSD_FLOOR].tolist()
