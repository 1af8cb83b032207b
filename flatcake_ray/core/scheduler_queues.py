"""FC-MAS's queues: the waiting pools a prefetch is chosen from and the ready lines a
dispatch pops from, one of each per policy (``scheduler.py`` holds the contract).

Waiting SSD requests: :class:`HrrnPool` (fc-mas; highest response ratio, numpy struct of
arrays with swap-remove, one vectorised pass per choice) or :class:`FifoPool` (fcfs; arrival
order). Ready requests: :class:`ReadyHeap` (fc-mas; oldest arrival first) or
:class:`FcfsLine` (fcfs; every live request in arrival order, a head not ready blocks).
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict

import numpy as np

from flatcake_ray.core.scheduler_types import Phase, RequestId, ScheduledRequest


class WaitStat:
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


class LiveRequest:
    """A request between submit and dispatch; ``seq`` tells a reused id's entries apart."""

    __slots__ = ("phase", "request", "seq")

    def __init__(self, request: ScheduledRequest, phase: Phase, seq: int) -> None:
        self.request, self.phase, self.seq = request, phase, seq


class HrrnPool:
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

    def add(self, live: LiveRequest) -> None:
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


class FifoPool:
    """Waiting SSD requests in submission order (fcfs); a request released from a hold goes
    back to its place by (arrival, seq), not to the end."""

    def __init__(self) -> None:
        self._order: list[tuple[float, int]] = []  # (arrival, seq), sorted
        self._key: dict[RequestId, tuple[float, int]] = {}
        self._ids: dict[tuple[float, int], RequestId] = {}

    def __len__(self) -> int:
        return len(self._order)

    def add(self, live: LiveRequest) -> None:
        key = (live.request.arrival, live.seq)
        if self._order and key < self._order[-1]:
            bisect.insort(self._order, key)
        else:
            self._order.append(key)
        self._key[live.request.request_id] = key
        self._ids[key] = live.request.request_id

    def remove(self, request_id: RequestId) -> None:
        key = self._key.pop(request_id)
        del self._ids[key]
        if self._order[0] == key:
            self._order.pop(0)
        else:
            del self._order[bisect.bisect_left(self._order, key)]

    def peek(self, now: float) -> RequestId | None:
        return self._ids[self._order[0]] if self._order else None


class ReadyHeap:
    """fc-mas ready queue: (arrival, seq) heap; cancelled entries are dropped when popped."""

    def __init__(self, live: dict[RequestId, LiveRequest]) -> None:
        self._live = live
        self._heap: list[tuple[float, int, RequestId]] = []

    def enlist_new(self, live: LiveRequest) -> None:
        pass  # a request joins the heap once ready (admit)

    def admit(self, live: LiveRequest) -> None:
        heapq.heappush(self._heap, (live.request.arrival, live.seq, live.request.request_id))

    def discard(self, live: LiveRequest) -> None:
        pass  # lazy: pop skips an entry whose id is gone or was reused (seq differs)

    def pop(self, max_n: int) -> list[LiveRequest]:
        taken: list[LiveRequest] = []
        while self._heap and len(taken) < max_n:
            _, seq, request_id = heapq.heappop(self._heap)
            live = self._live.get(request_id)
            if live is not None and live.seq == seq:
                taken.append(live)
        return taken


class FcfsLine:
    """fcfs: every live request in arrival order; a head that is not ready blocks the line."""

    def __init__(self, live: dict[RequestId, LiveRequest]) -> None:
        self._live = live
        self._line: OrderedDict[RequestId, None] = OrderedDict()

    def enlist_new(self, live: LiveRequest) -> None:
        self._line[live.request.request_id] = None

    def admit(self, live: LiveRequest) -> None:
        pass  # already in line since submit

    def discard(self, live: LiveRequest) -> None:
        del self._line[live.request.request_id]

    def pop(self, max_n: int) -> list[LiveRequest]:
        taken: list[LiveRequest] = []
        while self._line and len(taken) < max_n:
            head = self._live[next(iter(self._line))]
            if head.phase is not Phase.READY:
                break
            self._line.popitem(last=False)
            taken.append(head)
        return taken
