"""A storage node's leases: what readers hold, and how a lease travels to them.

A lease pins the scopes of a request's hits in the node's store; it is released by its reader
or, after ``lease_ttl_s``, by the node (the reader is presumed gone). :func:`wire_parts` turns
a lease into the per-segment description a reader on any node needs: medium, offset, layout,
per-layer checksums, and which pages go where (no keys, no bytes).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import numpy as np

from flatcake_ray.actors.protocol import SegmentPart
from flatcake_ray.core.catalog import Lease
from flatcake_ray.node.store import FlatCakeStore


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


def wire_parts(store: FlatCakeStore, lease: Lease) -> tuple[SegmentPart, ...]:
    parts = []
    for part in store.reader.parts(lease):
        segment = part.segment
        parts.append(
            SegmentPart(
                segment.scope_id,
                segment.medium,
                segment.offset,
                segment.layout.pages,
                segment.layout.page_bytes,
                segment.layout.layer_stride,
                np.array(segment.checksums, dtype=np.uint64),
                np.asarray(part.src_pages, dtype=np.int64),
                np.asarray(part.dst_positions, dtype=np.int64),
            )
        )
    return tuple(parts)
