"""Reclamation of a catalog's scopes: which scope goes first, and freeing or quarantining a
scope whole.

Only unreferenced scopes are freed, oldest first (:class:`ScopeTable`'s age orders); on DRAM,
replica scopes go before any home scope (no write-back: the SSD copy stays). A catalog
reclaims only its own scopes: a tenant over its quota, or a medium above its high watermark,
frees this tenant's oldest unreferenced scopes, never another's.

Who calls what: allocation calls :meth:`Reclamation.reclaim` and
:meth:`Reclamation.reclaim_oldest` to make room for a put; the store calls
:meth:`Reclamation.free_scope` (a tenant removed) and :meth:`Reclamation.quarantine` (a bad
checksum) through the catalog. ``on_free`` hears of every home scope freed (the store logs
SSD frees in its manifest).
"""

from __future__ import annotations

from collections.abc import Callable

from flatcake_ray.core.gva import Medium
from flatcake_ray.core.index import PageIndex
from flatcake_ray.core.records import Scope, Segment
from flatcake_ray.core.replicas import Replicas
from flatcake_ray.core.scopes import ScopeTable
from flatcake_ray.core.usage import MediaUse


class Reclamation:
    """Frees the scopes of one catalog: its ``scopes``, ``segments`` and ``index``, its
    ``use`` of the media and its ``replicas``; ``counters`` are reclamation's own."""

    def __init__(
        self,
        use: MediaUse,
        scopes: ScopeTable,
        segments: dict[int, Segment],
        index: PageIndex,
        replicas: Replicas,
        on_free: Callable[[Scope], None] | None = None,
    ) -> None:
        self._use = use
        self._scopes = scopes
        self._segments = segments
        self._index = index
        self._replicas = replicas
        self._on_free = on_free
        self.counters = dict.fromkeys(
            ("reclaimed_scopes", "reclaimed_bytes", "quarantined_scopes"), 0
        )

    def reclaim(self, medium: Medium, target: float) -> list[Scope]:
        """Free the oldest unreferenced scopes until ``medium`` is at most ``target`` full
        (of the quota, if there is one); on DRAM, replica scopes first."""
        freed = []
        while self._use.fraction(medium) > target:
            scope = self.reclaim_oldest(medium)
            if scope is None:
                break
            freed.append(scope)
        return freed

    def reclaim_oldest(self, medium: Medium) -> Scope | None:
        """Free the one scope that goes first on ``medium``; None when every one is pinned."""
        if medium is Medium.DRAM:
            replica = self._replicas.drop_oldest()
            if replica is not None:
                return replica
        scope = self._scopes.oldest_unreferenced(medium)
        if scope is not None:
            self.free_scope(scope)
            self.counters["reclaimed_scopes"] += 1
        return scope

    def free_scope(self, scope: Scope) -> int:
        """Drop a scope whole: its keys leave the index at once, its runs return to the pool,
        and its replicas go with it."""
        if scope.is_replica:
            return self._replicas.free(scope)
        self._forget_segments(scope)
        self._use.used[scope.medium] -= scope.runs.used_bytes
        freed = self._use.space[scope.medium].release(scope.runs)
        self.counters["reclaimed_bytes"] += freed
        self._scopes.drop(scope)
        if self._on_free is not None:
            self._on_free(scope)
        return freed

    def quarantine(self, scope_id: int) -> None:
        """A scope with a bad checksum: its keys go at once; its space is never reused. A bad
        replica takes only itself: its segments are read from SSD again."""
        scope = self._scopes.get(scope_id)
        if scope is None:
            return
        if scope.is_replica:
            for segment_id in scope.segments:
                segment = self._segments.get(segment_id)
                if segment is not None:
                    segment.replica = None
        else:
            self._forget_segments(scope)
        scope.segments.clear()
        scope.runs.runs.clear()  # the runs stay allocated: suspect media is not handed out again
        self._scopes.drop(scope)
        self.counters["quarantined_scopes"] += 1

    def _forget_segments(self, scope: Scope) -> None:
        """A home scope's segments leave the catalog and the index, with their replicas."""
        for segment_id in scope.segments:
            segment = self._segments.pop(segment_id)
            self._index.delete(segment.digests)
            self._replicas.free_of(segment)
