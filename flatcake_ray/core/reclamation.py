"""Reclamation of a catalog's scopes: how full a medium is, which scope goes first, and
freeing or quarantining a scope whole.

A mixin of :class:`~flatcake_ray.core.catalog.Catalog` (it shares the catalog's scopes,
segments, index and space). Only unreferenced scopes are freed, oldest first (``_age``, one
order per medium, moved to the end on every use); on DRAM, replica scopes go before any home
scope (no write-back: the SSD copy stays).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from flatcake_ray.core.gva import Medium
from flatcake_ray.core.records import Scope
from flatcake_ray.core.replicas import ReplicaMixin

if TYPE_CHECKING:
    from flatcake_ray.core.index import PageIndex
    from flatcake_ray.core.put_checks import SessionId
    from flatcake_ray.core.records import Session


class ReclamationMixin(ReplicaMixin):
    index: PageIndex
    sessions: dict[SessionId, Session]
    used: dict[Medium, int]
    quota: dict[Medium, int | None]
    _age: dict[Medium, OrderedDict[int, None]]
    on_free: Callable[[Scope], None] | None

    def _fraction(self, medium: Medium, extra: int = 0) -> float:
        """How full ``medium`` is for this tenant: of its quota if it has one, else of the
        medium (``extra`` bytes counted as if placed)."""
        quota = self.quota[medium]
        if quota is not None:
            return (self.used[medium] + extra) / quota if quota else 1.0
        space = self.space[medium]
        return space.used_fraction + extra / space.capacity if space.capacity else 1.0

    def _ages(self, scope: Scope) -> OrderedDict[int, None]:
        return self._replica_age if scope.is_replica else self._age[scope.medium]

    def _touch(self, scope: Scope, ref_delta: int) -> None:
        scope.refs += ref_delta
        self._ages(scope).move_to_end(scope.scope_id)

    def reclaim(self, medium: Medium, target: float) -> list[Scope]:
        """Free this catalog's oldest unreferenced scopes until ``medium`` is at most
        ``target`` full (of the quota, if there is one); on DRAM, replica scopes first."""
        freed = []
        while self._fraction(medium) > target:
            scope = self._reclaim_oldest(medium)
            if scope is None:
                break
            freed.append(scope)
        return freed

    def _reclaim_oldest(self, medium: Medium) -> Scope | None:
        if medium is Medium.DRAM:
            replica = self._drop_oldest_replica()
            if replica is not None:
                return replica
        for scope_id in self._age[medium]:
            scope = self.scopes[scope_id]
            if scope.refs == 0:
                self.free_scope(scope)
                self.counters["reclaimed_scopes"] += 1
                return scope
        return None

    def free_scope(self, scope: Scope) -> int:
        """Drop a scope whole: its keys leave the index at once, its runs return to the pool,
        and its replicas go with it."""
        if scope.is_replica:
            return self._free_replicas(scope)
        for segment_id in scope.segments:
            segment = self.segments.pop(segment_id)
            self.index.delete(segment.digests)
            self._free_replicas_of(segment)
        self.used[scope.medium] -= scope.runs.used_bytes
        freed = self.space[scope.medium].release(scope.runs)
        self.counters["reclaimed_bytes"] += freed
        self._drop_scope(scope)
        if self.on_free is not None:
            self.on_free(scope)
        return freed

    def _drop_scope(self, scope: Scope) -> None:
        self.scopes.pop(scope.scope_id, None)
        self._ages(scope).pop(scope.scope_id, None)
        if scope.is_replica:
            return
        session = self.sessions.get(scope.session_id)
        if session is not None and session.scopes.get(scope.medium) == scope.scope_id:
            del session.scopes[scope.medium]

    def quarantine(self, scope_id: int) -> None:
        """A scope with a bad checksum: its keys go at once; its space is never reused. A bad
        replica takes only itself: its segments are read from SSD again."""
        scope = self.scopes.get(scope_id)
        if scope is None:
            return
        if scope.is_replica:
            for segment_id in scope.segments:
                segment = self.segments.get(segment_id)
                if segment is not None:
                    segment.replica = None
        else:
            for segment_id in scope.segments:
                segment = self.segments.pop(segment_id)
                self.index.delete(segment.digests)
                self._free_replicas_of(segment)
        scope.segments.clear()
        scope.runs.runs.clear()  # the runs stay allocated: suspect media is not handed out again
        self._drop_scope(scope)
        self.counters["quarantined_scopes"] += 1
