"""A catalog's scopes by id, and the order reclamation reads them in.

One age order per medium for home scopes and one for DRAM read replicas; a scope moves to the
end of its order on every use, so the first unreferenced scope of an order is the one that
has gone longest unused. Dropping a scope also clears its session's pointer to it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from flatcake_ray.core.extents import ScopeRuns
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.records import Scope, Session, SessionId


class ScopeTable:
    """Every live scope of one catalog. ``sessions`` is the catalog's own table: a session
    points at its home scope per medium, and a dropped scope takes that pointer with it."""

    def __init__(self, sessions: dict[SessionId, Session]) -> None:
        self.by_id: dict[int, Scope] = {}
        self._sessions = sessions
        self._age: dict[Medium, OrderedDict[int, None]] = {m: OrderedDict() for m in Medium}
        self._replica_age: OrderedDict[int, None] = OrderedDict()

    def __getitem__(self, scope_id: int) -> Scope:
        return self.by_id[scope_id]

    def __contains__(self, scope_id: int) -> bool:
        return scope_id in self.by_id

    def get(self, scope_id: int) -> Scope | None:
        return self.by_id.get(scope_id)

    def add(self, scope: Scope) -> None:
        """A new scope, the most recently used of its order."""
        self.by_id[scope.scope_id] = scope
        self._ages(scope)[scope.scope_id] = None

    def touch(self, scope: Scope, ref_delta: int) -> None:
        """``scope`` was just used: it goes last in its order (``ref_delta`` pins or unpins)."""
        scope.refs += ref_delta
        self._ages(scope).move_to_end(scope.scope_id)

    def drop(self, scope: Scope) -> None:
        """Forget ``scope`` (its runs are the caller's to release or keep)."""
        self.by_id.pop(scope.scope_id, None)
        self._ages(scope).pop(scope.scope_id, None)
        if scope.is_replica:
            return
        session = self._sessions.get(scope.session_id)
        if session is not None and session.scopes.get(scope.medium) == scope.scope_id:
            del session.scopes[scope.medium]

    def oldest_unreferenced(self, medium: Medium) -> Scope | None:
        """The home scope on ``medium`` unused longest that nothing pins, or None."""
        return self._first_unreferenced(self._age[medium])

    def oldest_unreferenced_replica(self) -> Scope | None:
        """The replica scope read longest ago that nothing pins, or None."""
        return self._first_unreferenced(self._replica_age)

    def freeable_runs(self, medium: Medium) -> list[ScopeRuns]:
        """The runs on ``medium`` of every unreferenced scope, oldest first (replicas last)."""
        return [scope.runs for scope in self._in_age_order(medium) if scope.refs == 0]

    def _in_age_order(self, medium: Medium) -> Iterator[Scope]:
        yield from (self.by_id[s] for s in self._age[medium])
        if medium is Medium.DRAM:
            yield from (self.by_id[s] for s in self._replica_age)

    def _first_unreferenced(self, ages: OrderedDict[int, None]) -> Scope | None:
        for scope_id in ages:
            scope = self.by_id[scope_id]
            if scope.refs == 0:
                return scope
        return None

    def _ages(self, scope: Scope) -> OrderedDict[int, None]:
        return self._replica_age if scope.is_replica else self._age[scope.medium]
