"""A storage node's leases: what readers hold, and how a lease travels to them.

A lease pins the scopes of a request's hits in the node's store; it is released by its reader
or, after ``lease_ttl_s``, by the node (the reader is presumed gone). Readers get the lease's
pages as :class:`~flatcake_ray.core.parts.LeasePart` s (no keys, no bytes).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from flatcake_ray.core.catalog import Lease


class LeaseTable:
    """Leases handed to readers, oldest first; those past their TTL are released."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._held: OrderedDict[int, tuple[Lease, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.expired = 0

    def add(self, lease: Lease) -> None:
        with self._lock:
            self._held[lease.lease_id] = (lease, time.monotonic() + self.ttl_s)

    def pop(self, lease_id: int) -> Lease | None:
        with self._lock:
            held = self._held.pop(lease_id, None)
        return None if held is None else held[0]

    def expire(self, now: float) -> list[Lease]:
        gone = []
        with self._lock:
            while self._held:
                lease_id, (lease, deadline) = next(iter(self._held.items()))
                if deadline >= now:
                    break
                del self._held[lease_id]
                gone.append(lease)
        self.expired += len(gone)
        return gone

    def __len__(self) -> int:
        return len(self._held)
