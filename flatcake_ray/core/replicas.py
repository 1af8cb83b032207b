"""DRAM read replicas of SSD segments (``placement.py``): where one goes, when it goes.

A replica is a :class:`Segment` with the home segment's id, layout, digests and checksums, its
own DRAM offset, in a replica scope of its own (``Scope.replica_of`` = the home scope), so one
replica is dropped at a time, least recently read first, with no write-back (the SSD copy
stays). Replicas take only free DRAM or the room of older replicas, never a home scope's.

Who calls what: the catalog asks :meth:`Replicas.plan` for a place while planning a put that
placement says to replicate, and :meth:`Replicas.publish` when that put is published (an
aborted put gives the replica's space back through allocation, like any unwritten segment);
reclamation calls :meth:`Replicas.drop_oldest` before it frees any home scope on DRAM,
:meth:`Replicas.free_of` when a home segment goes, and :meth:`Replicas.free` for a replica
scope it is asked to free.
"""

from __future__ import annotations

from flatcake_ray.config import StoreConfig
from flatcake_ray.core.extents import MediumSpace
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.records import Ids, Scope, Segment
from flatcake_ray.core.scopes import ScopeTable


class Replicas:
    """The replicas of one catalog: its ``scopes`` and ``segments`` tables, the store's
    ``dram`` space and id source ``ids``; ``counters`` are the replicas' own."""

    def __init__(
        self,
        config: StoreConfig,
        dram: MediumSpace,
        scopes: ScopeTable,
        segments: dict[int, Segment],
        ids: Ids,
        owner: str | None = None,
    ) -> None:
        self._owner = owner  # whose DRAM regions replicas take, on an owned arena
        self._high_watermark = config.high_watermark
        self._dram = dram
        self._scopes = scopes
        self._segments = segments
        self._ids = ids
        self.counters = dict.fromkeys(
            (
                "replicas_written",
                "replicas_refused",
                "replica_scopes_dropped",
                "replica_bytes_dropped",
            ),
            0,
        )

    def plan(self, home: Scope, segment: Segment) -> Segment | None:
        """A DRAM place for a copy of ``segment`` (in a replica scope of its own, pinned until
        published or given back), taken only from free DRAM or from less recently read
        replicas, never from a home scope; None when there is none."""
        space = self._dram
        nbytes = segment.layout.nbytes
        if nbytes > space.capacity * self._high_watermark:
            self.counters["replicas_refused"] += 1
            return None
        scope = Scope(next(self._ids), home.session_id, Medium.DRAM, replica_of=home.scope_id)
        scope.runs.owner = self._owner
        self._scopes.add(scope)
        scope.refs += 1  # not dropped while we make room for it
        try:
            offset = None
            while offset is None:
                if space.used_fraction + nbytes / space.capacity <= self._high_watermark:
                    offset = space.place(scope.runs, nbytes, reserve_ahead=False)
                if offset is None and self.drop_oldest() is None:
                    break
        finally:
            scope.refs -= 1
        if offset is None:
            self.counters["replicas_refused"] += 1
            space.release(scope.runs)
            self._scopes.drop(scope)
            return None
        scope.refs += 1  # an in-flight write pins its replica scope too
        return Segment(
            segment.segment_id, scope.scope_id, Medium.DRAM, offset, segment.layout, segment.digests
        )

    def publish(self, replica: Segment, segment: Segment) -> None:
        """``replica`` holds ``segment``'s bytes: readers are handed it from now on."""
        scope = self._scopes[replica.scope_id]
        scope.refs -= 1
        replica.checksums = segment.checksums  # the same bytes
        segment.replica = replica
        scope.segments.append(segment.segment_id)
        scope.pages += segment.layout.pages
        self.counters["replicas_written"] += 1
        self._scopes.touch(scope, 0)

    def drop_oldest(self) -> Scope | None:
        """Drop the unreferenced replica read longest ago; None when every one is pinned."""
        scope = self._scopes.oldest_unreferenced_replica()
        if scope is not None:
            self.free(scope)
        return scope

    def free(self, scope: Scope) -> int:
        """Drop a replica scope: its segment is read from SSD again; nothing is written."""
        for segment_id in scope.segments:
            segment = self._segments.get(segment_id)
            if segment is not None:
                segment.replica = None
        freed = self._dram.release(scope.runs)
        self.counters["replica_scopes_dropped"] += 1
        self.counters["replica_bytes_dropped"] += freed
        self._scopes.drop(scope)
        return freed

    def free_of(self, segment: Segment) -> None:
        """``segment`` is going: its replica, if any, goes with it."""
        if segment.replica is not None and segment.replica.scope_id in self._scopes:
            self.free(self._scopes[segment.replica.scope_id])
