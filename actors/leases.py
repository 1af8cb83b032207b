"""A storage node's leases: what readers hold, who holds them, and what they may read.

A lease pins the scopes of a request's hits in the node's store; it is released by its reader
or, after ``lease_ttl_s``, by the node (the reader is presumed gone). Its id, the reader's
only handle on it, is 63 random bits: nobody can name a lease they were not given. It belongs
to the tenant that took it; a release of a lease one does not hold (unknown, expired or
another tenant's) is refused, counted, and changes nothing. Readers get the lease's pages as
:class:`~flatcake_ray.core.parts.LeasePart` s (no keys, no bytes).

The node's byte-serving calls (``ship``, ``read_ranges``) serve only ranges inside the runs
of scopes the calling tenant holds a lease on (:meth:`LeaseTable.ranges`).
"""

from __future__ import annotations

import bisect
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from flatcake_ray.core.catalog import Lease
from flatcake_ray.core.gva import Medium

Ranges = Callable[[Lease, Medium], Iterable[tuple[int, int]]]


class LeaseTable:
    """Leases handed to readers, oldest first; those past their TTL are released."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._held: OrderedDict[int, tuple[Lease, float]] = OrderedDict()
        self._lock = threading.Lock()
        self._by_tenant: Counter[str] = Counter()
        self.counters = {"leases_expired": 0, "releases_unknown": 0, "releases_foreign": 0}

    def add(self, lease: Lease) -> int:
        """Hold ``lease``; returns the id its reader releases it by."""
        lease_id = secrets.randbits(63)
        with self._lock:
            self._held[lease_id] = (lease, time.monotonic() + self.ttl_s)
            self._by_tenant[lease.tenant] += 1
        return lease_id

    def held_by(self, tenant: str) -> int:
        """How many leases ``tenant`` holds here."""
        return self._by_tenant[tenant]

    def _forget(self, lease_id: int) -> Lease:
        lease = self._held.pop(lease_id)[0]
        self._by_tenant[lease.tenant] -= 1
        if not self._by_tenant[lease.tenant]:
            del self._by_tenant[lease.tenant]
        return lease

    def pop(self, lease_id: object, tenant: str) -> Lease | None:
        """The lease ``lease_id`` if ``tenant`` holds it (it is no longer held); else None,
        counted, and nothing changes."""
        with self._lock:
            held = self._held.get(lease_id) if isinstance(lease_id, int) else None
            if held is None or not isinstance(lease_id, int):
                self.counters["releases_unknown"] += 1
                return None
            if held[0].tenant != tenant:
                self.counters["releases_foreign"] += 1
                return None
            self._forget(lease_id)
        return held[0]

    def expire(self, now: float) -> list[Lease]:
        gone = []
        with self._lock:
            while self._held:
                lease_id, (_, deadline) = next(iter(self._held.items()))
                if deadline >= now:
                    break
                gone.append(self._forget(lease_id))
        self.counters["leases_expired"] += len(gone)
        return gone

    def drop_tenant(self, tenant: str) -> list[Lease]:
        """Forget every lease of ``tenant`` (it was removed); returns them."""
        with self._lock:
            ids = [i for i, (lease, _) in self._held.items() if lease.tenant == tenant]
            return [self._forget(i) for i in ids]

    def ranges(self, tenant: str, medium: Medium, runs_of: Ranges) -> LeasedRanges:
        """The medium ranges ``tenant``'s held leases cover (``runs_of`` lists a lease's)."""
        with self._lock:
            leases = [lease for lease, _ in self._held.values() if lease.tenant == tenant]
        return LeasedRanges(span for lease in leases for span in runs_of(lease, medium))

    def __len__(self) -> int:
        return len(self._held)


class LeasedRanges:
    """Sorted, merged ``[start, end)`` spans; :meth:`covers` checks a read against them."""

    def __init__(self, spans: Iterable[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self._starts = [s for s, _ in merged]
        self._ends = [e for _, e in merged]

    def covers(self, start: int, length: int) -> bool:
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and start + length <= self._ends[i]
