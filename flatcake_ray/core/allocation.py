"""Space for a catalog's puts: a session's scope on a medium, room in its run (reclaiming
unreferenced scopes when needed), tenant quotas, and giving unwritten space back.

Space is taken in a session's scope so its turns stay contiguous; nothing is evicted for a
put that would not fit even after reclaiming.

Who calls what: the catalog calls :meth:`Allocation.allocate` while planning a put (then pins
the scope it got for the write), :meth:`Allocation.dram_headroom` to tell placement whether
DRAM has room, and :meth:`Allocation.give_back` for each segment (and replica) of an aborted
put. Allocation asks reclamation for room; it never frees a scope itself.
"""

from __future__ import annotations

from flatcake_ray.config import StoreConfig
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.reclamation import Reclamation
from flatcake_ray.core.records import Ids, Scope, Segment, Session
from flatcake_ray.core.scopes import ScopeTable
from flatcake_ray.core.usage import MediaUse


class Allocation:
    """Allocates for one catalog: its ``scopes``, its ``use`` of the store's media (shared
    space, its own quota), its ``reclamation``, and the store's id source ``ids``; its scopes'
    runs come from ``owner``'s regions on an owned medium (``core/extents.py``)."""

    def __init__(
        self,
        config: StoreConfig,
        use: MediaUse,
        scopes: ScopeTable,
        reclamation: Reclamation,
        ids: Ids,
        owner: str | None = None,
    ) -> None:
        self._owner = owner
        self._config = config
        self._use = use
        self._scopes = scopes
        self._reclamation = reclamation
        self._ids = ids

    def dram_headroom(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more would leave DRAM at most at its low watermark."""
        return self._use.fraction(Medium.DRAM, nbytes) <= self._config.low_watermark

    def allocate(
        self, session: Session, medium: Medium, nbytes: int, reserve_ahead: bool
    ) -> tuple[Scope | None, int]:
        """Room for ``nbytes`` in ``session``'s scope on ``medium``, reclaiming unreferenced
        scopes if needed; (None, 0), with nothing evicted, when even that would not make it.
        Space held ahead keeps a session's turns together in one run; a first turn is mostly
        never continued (69% of Mooncake sessions), so it takes only what it needs: held-ahead
        space of first turns was 43% of the SSD the Mooncake replay had reserved, and SSD
        reclamation then dropped sessions that were coming back."""
        space = self._use.space[medium]
        if nbytes > space.region_bytes or not space.allocators:
            return None, 0  # a run never crosses a region (one arena, one pool file)
        scope = self._scope_for(session, medium)
        scope.refs += 1  # keep reclamation away from the scope we are growing
        before = scope.runs.used_bytes
        try:
            offset = None
            if self._obtainable(medium, scope, nbytes) and self._fits_quota(medium, nbytes):
                high, low = self._watermarks(medium)
                if self._use.fraction(medium, nbytes) > high:
                    self._reclamation.reclaim(medium, target=low)
                offset = space.place(scope.runs, nbytes, reserve_ahead=reserve_ahead)
                while offset is None and self._reclamation.reclaim_oldest(medium):
                    offset = space.place(scope.runs, nbytes, reserve_ahead=reserve_ahead)
        finally:
            scope.refs -= 1
            self._use.used[medium] += scope.runs.used_bytes - before
        if offset is None:
            self._drop_if_unused(scope)
            return None, 0
        return scope, offset

    def give_back(self, segment: Segment) -> None:
        """An unwritten segment's space returns (exactly when it is still its run's tail)."""
        scope = self._scopes[segment.scope_id]
        scope.refs -= 1
        before = scope.runs.used_bytes
        last = scope.runs.runs[-1] if scope.runs.runs else None
        if last is not None and last.start + last.used == segment.offset + segment.layout.nbytes:
            last.used -= segment.layout.nbytes
        if not scope.is_replica:  # replicas are not the tenant's use (they are dropped first)
            self._use.used[scope.medium] += scope.runs.used_bytes - before
        self._drop_if_unused(scope)

    def _watermarks(self, medium: Medium) -> tuple[float, float]:
        """(high, low): past ``high`` full, ``medium`` is reclaimed ahead down to ``low``."""
        config = self._config
        if medium is Medium.DRAM:
            return config.high_watermark, config.low_watermark
        return config.ssd_high_watermark, config.ssd_low_watermark

    def _fits_quota(self, medium: Medium, nbytes: int) -> bool:
        """Whether ``nbytes`` more stay within this tenant's quota, once its own unreferenced
        scopes are reclaimed if need be (reclaiming them as needed)."""
        quota = self._use.quota[medium]
        if quota is None:
            return True
        if nbytes > quota:
            return False
        while self._use.used[medium] + nbytes > quota:
            if self._reclamation.reclaim_oldest(medium) is None:
                return False
        return True

    def _obtainable(self, medium: Medium, scope: Scope, nbytes: int) -> bool:
        """Whether ``nbytes`` fit now, or would once every unreferenced scope were freed."""
        space = self._use.space[medium]
        last = scope.runs.runs[-1] if scope.runs.runs else None
        if space.largest_free_to(scope.runs.owner) >= nbytes or (
            last is not None and last.room >= nbytes
        ):
            return True
        freeable = self._scopes.freeable_runs(medium)
        return space.largest_obtainable(freeable, scope.runs) >= nbytes

    def _scope_for(self, session: Session, medium: Medium) -> Scope:
        scope_id = session.scopes.get(medium)
        if scope_id is not None and scope_id in self._scopes:
            return self._scopes[scope_id]
        scope = Scope(next(self._ids), session.session_id, medium)
        scope.runs.owner = self._owner
        self._scopes.add(scope)
        session.scopes[medium] = scope.scope_id
        return scope

    def _drop_if_unused(self, scope: Scope) -> None:
        """A scope that never got a segment and that no put is writing gives its runs back."""
        if not scope.segments and scope.refs == 0:
            if not scope.is_replica:
                self._use.used[scope.medium] -= scope.runs.used_bytes
            self._use.space[scope.medium].release(scope.runs)
            self._scopes.drop(scope)
