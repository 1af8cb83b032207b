"""DRAM read replicas of SSD segments (``placement.py``): where one goes, when it goes.

A mixin of :class:`~flatcake_ray.core.catalog.Catalog`: the replica's bookkeeping lives
beside the catalog's scopes, segments and space, which it shares. A replica is a
:class:`Segment` with the home segment's id, layout, digests and checksums, its own DRAM
offset, in a replica scope of its own (``Scope.replica_of`` = the home scope), so one replica
is dropped at a time, least recently read first (``_replica_age``), with no write-back.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from flatcake_ray.core.gva import Medium
from flatcake_ray.core.records import Scope, Segment

if TYPE_CHECKING:
    from flatcake_ray.config import StoreConfig
    from flatcake_ray.core.extents import MediumSpace
    from flatcake_ray.core.records import Ids


class ReplicaMixin:
    config: StoreConfig
    space: dict[Medium, MediumSpace]
    scopes: dict[int, Scope]
    segments: dict[int, Segment]
    counters: dict[str, int]
    _ids: Ids
    _replica_age: OrderedDict[int, None]

    if TYPE_CHECKING:  # the catalog's own

        def _drop_if_unused(self, scope: Scope) -> None: ...
        def _drop_scope(self, scope: Scope) -> None: ...
        def _touch(self, scope: Scope, ref_delta: int) -> None: ...

    def _plan_replica(self, home: Scope, segment: Segment) -> Segment | None:
        """A DRAM place for a copy of ``segment`` (in a replica scope of its own), taken only
        from free DRAM or from less recently read replicas, never from a home scope; None
        when there is none."""
        space = self.space[Medium.DRAM]
        nbytes = segment.layout.nbytes
        if nbytes > space.capacity * self.config.high_watermark:
            self.counters["replicas_refused"] += 1
            return None
        scope = Scope(next(self._ids), home.session_id, Medium.DRAM, replica_of=home.scope_id)
        self.scopes[scope.scope_id] = scope
        self._replica_age[scope.scope_id] = None
        scope.refs += 1  # not dropped while we make room for it
        try:
            offset = None
            while offset is None:
                if space.used_fraction + nbytes / space.capacity <= self.config.high_watermark:
                    offset = space.place(scope.runs, nbytes, reserve_ahead=False)
                if offset is None and self._drop_oldest_replica() is None:
                    break
        finally:
            scope.refs -= 1
        if offset is None:
            self.counters["replicas_refused"] += 1
            self._drop_if_unused(scope)
            return None
        scope.refs += 1  # an in-flight write pins its replica scope too
        return Segment(
            segment.segment_id, scope.scope_id, Medium.DRAM, offset, segment.layout, segment.digests
        )

    def _drop_oldest_replica(self) -> Scope | None:
        for scope_id in self._replica_age:
            scope = self.scopes[scope_id]
            if scope.refs == 0:
                self._free_replicas(scope)
                return scope
        return None

    def _free_replicas(self, scope: Scope) -> int:
        """Drop a replica scope: its segment is read from SSD again; nothing is written."""
        for segment_id in scope.segments:
            segment = self.segments.get(segment_id)
            if segment is not None:
                segment.replica = None
        freed = self.space[Medium.DRAM].release(scope.runs)
        self.counters["replica_scopes_dropped"] += 1
        self.counters["replica_bytes_dropped"] += freed
        self._drop_scope(scope)
        return freed

    def _publish_replica(self, replica: Segment, segment: Segment) -> None:
        scope = self.scopes[replica.scope_id]
        scope.refs -= 1
        replica.checksums = segment.checksums  # the same bytes
        segment.replica = replica
        scope.segments.append(segment.segment_id)
        scope.pages += segment.layout.pages
        self.counters["replicas_written"] += 1
        self._touch(scope, 0)

    def _free_replicas_of(self, segment: Segment) -> None:
        if segment.replica is not None and segment.replica.scope_id in self.scopes:
            self._free_replicas(self.scopes[segment.replica.scope_id])
