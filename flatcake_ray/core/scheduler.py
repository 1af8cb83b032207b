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
request. fcfs is O(1) throughout.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import Enum
from numbers import Integral, Real

import numpy as np

from flatcake_ray.core.gva import Medium, slowest_medium
from flatcake_ray.errors import (
    ClockError,
    ConfigError,
    DuplicateRequestError,
    InvalidRequestError,
    RequestStateError,
    UnknownRequestError,
)

RequestId = Hashable
POLICIES = ("fc-mas", "fcfs")


def response_ratio(wait: float, kv_bytes: int) -> float:
    """Paper Eq. 1, ``1 + wait / kv_bytes``; a zero-byte request counts as one byte."""
    return 1.0 + wait / max(kv_bytes, 1)


class Phase(Enum):
    WAITING = "waiting"  # SSD request whose prefetch has not started
    PREFETCHING = "prefetching"
    READY = "ready"


@dataclass(frozen=True)
class SchedulerConfig:
    max_inflight_prefetches: int = 4
    max_inflight_bytes: int | None = None  # staging window; None: count limit only
    policy: str = "fc-mas"  # "fc-mas" or "fcfs"
    starvation_limit: float | None = None  # seconds; None: pure HRRN

    def __post_init__(self) -> None:
        if not _is_int(self.max_inflight_prefetches) or self.max_inflight_prefetches < 1:
            raise ConfigError("max_inflight_prefetches must be an integer >= 1")
        window = self.max_inflight_bytes
        if window is not None and (not _is_int(window) or window < 1):
            raise ConfigError("max_inflight_bytes must be None or an integer >= 1")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, not {self.policy!r}")
        limit = self.starvation_limit
        if limit is not None and not (_is_real(limit) and math.isfinite(limit) and limit >= 0):
            raise ConfigError("starvation_limit must be None or a finite number >= 0")


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request_id: RequestId
    arrival: float
    kv_bytes: int  # SSD bytes to prefetch; 0 for a DRAM-ready request
    medium: Medium  # slowest medium its hits touch


@dataclass(frozen=True)
class SchedulerStats:
    ready: int
    waiting_prefetch: int
    inflight_prefetches: int
    inflight_bytes: int
    max_inflight_prefetches_seen: int
    max_inflight_bytes_seen: int
    prefetches_started: int
    prefetches_completed: int
    dispatched_dram: int
    dispatched_ssd: int
    cancelled: int
    mean_wait_dram: float  # arrival -> dispatch, seconds; 0.0 before the first
    max_wait_dram: float
    mean_wait_ssd: float
    max_wait_ssd: float
    mean_prefetch_queue_wait: float  # arrival -> prefetch start
    max_prefetch_queue_wait: float


# The exact-type tests first: ABC isinstance checks are a third of a replay run's time.
def _is_int(value: object) -> bool:
    return type(value) is int or (isinstance(value, Integral) and not isinstance(value, bool))


def _is_real(value: object) -> bool:
    return type(value) is float or (isinstance(value, Real) and not isinstance(value, bool))


class _WaitStat:
    __slots__ = ("count", "max", "total")

    def __init__(self) -> None:
        self.count, self.total, self.max = 0, 0.0, 0.0

    def add(self, wait: float) -> None:
        self.count += 1
        self.total += wait
        self.max = max(self.max, wait)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


class _Live:
    """A request between submit and dispatch; ``seq`` tells a reused id's entries apart."""

    __slots__ = ("phase", "request", "seq")

    def __init__(self, request: ScheduledRequest, phase: Phase, seq: int) -> None:
        self.request, self.phase, self.seq = request, phase, seq


class _HrrnPool:
    """Waiting SSD requests, chosen by highest response ratio (struct of arrays)."""

    def __init__(self, starvation_limit: float | None) -> None:
        self._limit = starvation_limit
        self._ids: list[RequestId] = []
        self._slot: dict[RequestId, int] = {}
        self._arrival = np.empty(64)
        self._size = np.empty(64)  # max(kv_bytes, 1): the Eq. 1 guard for empty prefetches
        self._seq = np.empty(64, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, live: _Live) -> None:
        slot = len(self._ids)
        if slot == self._arrival.size:
            self._arrival, self._size, self._seq = (
                np.concatenate([a, np.empty_like(a)])
                for a in (self._arrival, self._size, self._seq)
            )
        self._arrival[slot] = live.request.arrival
        self._size[slot] = max(live.request.kv_bytes, 1)
        self._seq[slot] = live.seq
        self._ids.append(live.request.request_id)
        self._slot[live.request.request_id] = slot

    def remove(self, request_id: RequestId) -> None:
        slot, last = self._slot.pop(request_id), len(self._ids) - 1
        if slot != last:  # swap the last entry into the hole so the arrays stay dense
            moved = self._ids[last]
            self._ids[slot], self._slot[moved] = moved, slot
            for column in (self._arrival, self._size, self._seq):
                column[slot] = column[last]
        self._ids.pop()

    def peek(self, now: float) -> RequestId | None:
        count = len(self._ids)
        if count <= 1:
            return self._ids[0] if count else None
        arrival, size, seq = self._arrival[:count], self._size[:count], self._seq[:count]
        wait = now - arrival
        if self._limit is not None:
            starved = np.flatnonzero(wait >= self._limit)
            if starved.size:
                return self._ids[_first(starved, arrival, seq)]
        # Compare wait/size, not 1 + wait/size: adding 1 would round away ratios below 1e-16.
        ratio = wait / size
        best = np.flatnonzero(ratio == ratio.max())
        # A tie goes to the request that leads an instant later: the smaller one's ratio grows
        # faster; then the older one.
        return self._ids[_first(best, size, arrival, seq)]


def _first(candidates: np.ndarray, *keys: np.ndarray) -> int:
    """The candidate slot that sorts first by ``keys`` (most significant first; the last,
    ``seq``, is unique). Filters by each key's minimum: O(W) per key, no sort."""
    for key in keys:
        if candidates.size == 1:
            break
        values = key[candidates]
        candidates = candidates[values == values.min()]
    return int(candidates[0])


class _FifoPool:
    """Waiting SSD requests in arrival order (fcfs)."""

    def __init__(self) -> None:
        self._order: OrderedDict[RequestId, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def add(self, live: _Live) -> None:
        self._order[live.request.request_id] = None

    def remove(self, request_id: RequestId) -> None:
        del self._order[request_id]

    def peek(self, now: float) -> RequestId | None:
        return next(iter(self._order), None)


class _ReadyHeap:
    """fc-mas ready queue: (arrival, seq) heap; cancelled entries are dropped when popped."""

    def __init__(self, live: dict[RequestId, _Live]) -> None:
        self._live = live
        self._heap: list[tuple[float, int, RequestId]] = []

    def enlist(self, live: _Live) -> None:
        if live.phase is Phase.READY:
            self.admit(live)

    def admit(self, live: _Live) -> None:
        heapq.heappush(self._heap, (live.request.arrival, live.seq, live.request.request_id))

    def discard(self, live: _Live) -> None:
        pass  # lazy: pop skips an entry whose id is gone or was reused (seq differs)

    def pop(self, max_n: int) -> list[_Live]:
        taken: list[_Live] = []
        while self._heap and len(taken) < max_n:
            _, seq, request_id = heapq.heappop(self._heap)
            live = self._live.get(request_id)
            if live is not None and live.seq == seq:
                taken.append(live)
        return taken


class _FcfsLine:
    """fcfs: every live request in arrival order; a head that is not ready blocks the line."""

    def __init__(self, live: dict[RequestId, _Live]) -> None:
        self._live = live
        self._line: OrderedDict[RequestId, None] = OrderedDict()

    def enlist(self, live: _Live) -> None:
        self._line[live.request.request_id] = None

    def admit(self, live: _Live) -> None:
        pass  # already in line since submit

    def discard(self, live: _Live) -> None:
        del self._line[live.request.request_id]

    def pop(self, max_n: int) -> list[_Live]:
        taken: list[_Live] = []
        while self._line and len(taken) < max_n:
            head = self._live[next(iter(self._line))]
            if head.phase is not Phase.READY:
                break
            self._line.popitem(last=False)
            taken.append(head)
        return taken


class Scheduler:
    """FC-MAS (or its fcfs baseline) for one engine; see the module docstring for the contract."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self._live: dict[RequestId, _Live] = {}
        fcmas = self.config.policy == "fc-mas"
        self._waiting = _HrrnPool(self.config.starvation_limit) if fcmas else _FifoPool()
        self._ready = _ReadyHeap(self._live) if fcmas else _FcfsLine(self._live)
        self._clock = -math.inf
        self._next_seq = 0
        self._ready_count = 0
        self._inflight_count = 0
        self._inflight_bytes = 0
        self._max_inflight_count = 0
        self._max_inflight_bytes = 0
        self._started = self._completed = self._cancelled = 0
        self._waits = {Medium.DRAM: _WaitStat(), Medium.SSD: _WaitStat()}
        self._queue_wait = _WaitStat()

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
    ) -> ScheduledRequest:
        """Classify a new request by its slowest medium and queue it."""
        arrival = self._checked_time(arrival)
        if request_id in self._live:
            raise DuplicateRequestError(f"request {request_id!r} is already queued")
        medium = _classify(gvas)
        if not _is_int(kv_bytes) or kv_bytes < 0:
            raise InvalidRequestError(f"kv_bytes must be an integer >= 0, not {kv_bytes!r}")
        if medium is Medium.DRAM and kv_bytes:
            raise InvalidRequestError(f"request {request_id!r} has no SSD hit but kv_bytes > 0")
        self._clock = arrival
        request = ScheduledRequest(request_id, arrival, int(kv_bytes), medium)
        phase = Phase.READY if medium is Medium.DRAM else Phase.WAITING
        live = _Live(request, phase, self._next_seq)
        self._next_seq += 1
        self._live[request_id] = live
        self._ready.enlist(live)
        if phase is Phase.READY:
            self._ready_count += 1
        else:
            self._waiting.add(live)
        return request

    def start_prefetches(self, now: float) -> list[ScheduledRequest]:
        """Move waiting SSD requests into flight while the budget allows; the caller starts them."""
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
        now = self._checked_time(now)
        live = self._get(request_id)
        if live.phase is not Phase.PREFETCHING:
            raise RequestStateError(
                f"request {request_id!r} is {live.phase.value}, not prefetching"
            )
        self._clock = now
        self._end_prefetch(live)
        self._completed += 1
        live.phase = Phase.READY
        self._ready_count += 1
        self._ready.admit(live)

    def pop_ready(self, now: float, max_n: int | None = 1) -> list[ScheduledRequest]:
        """Dispatch up to ``max_n`` (None: all) ready requests, oldest arrival first."""
        now = self._checked_time(now)
        if max_n is not None and (not _is_int(max_n) or max_n < 1):
            raise InvalidRequestError(f"max_n must be None or an integer >= 1, not {max_n!r}")
        self._clock = now
        taken = self._ready.pop(len(self._live) if max_n is None else max_n)
        for live in taken:
            del self._live[live.request.request_id]
            self._ready_count -= 1
            self._waits[live.request.medium].add(now - live.request.arrival)
        return [live.request for live in taken]

    def cancel(self, request_id: RequestId, now: float) -> Phase:
        """Forget a request not yet dispatched; returns the phase it was in."""
        now = self._checked_time(now)
        live = self._get(request_id)
        self._clock = now
        if live.phase is Phase.WAITING:
            self._waiting.remove(request_id)
        elif live.phase is Phase.PREFETCHING:
            self._end_prefetch(live)
        else:
            self._ready_count -= 1
        self._ready.discard(live)
        del self._live[request_id]
        self._cancelled += 1
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
        )

    def _checked_time(self, now: float) -> float:
        # Only checked here; each call commits it once all its checks passed, so a rejected
        # call leaves the scheduler exactly as it was.
        if not _is_real(now) or not math.isfinite(now):
            raise ClockError(f"time must be a finite number, not {now!r}")
        if now < self._clock:
            raise ClockError(f"time went backwards: {now!r} after {self._clock!r}")
        return float(now)

    def _get(self, request_id: RequestId) -> _Live:
        live = self._live.get(request_id)
        if live is None:
            raise UnknownRequestError(f"request {request_id!r} is not queued")
        return live

    def _fits(self, kv_bytes: int) -> bool:
        window = self.config.max_inflight_bytes
        if window is None or self._inflight_count == 0:
            return True  # an oversize request starts alone rather than never
        return self._inflight_bytes + kv_bytes <= window

    def _begin_prefetch(self, live: _Live, now: float) -> None:
        live.phase = Phase.PREFETCHING
        self._inflight_count += 1
        self._inflight_bytes += live.request.kv_bytes
        self._max_inflight_count = max(self._max_inflight_count, self._inflight_count)
        self._max_inflight_bytes = max(self._max_inflight_bytes, self._inflight_bytes)
        self._started += 1
        self._queue_wait.add(now - live.request.arrival)

    def _end_prefetch(self, live: _Live) -> None:
        self._inflight_count -= 1
        self._inflight_bytes -= live.request.kv_bytes


def _classify(gvas: np.ndarray | Sequence[int]) -> Medium:
    try:
        return slowest_medium(gvas if isinstance(gvas, np.ndarray) else list(gvas))
    except (OverflowError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"GVAs must be unsigned 64-bit integers: {exc}") from exc
