"""The first half of a put in the catalog: :meth:`PutPlanning.plan_put` resolves the session,
places the batch (paper Table 2), allocates its segment and pins the scope (mixed into
``Catalog``, which provides the attributes declared below; ``catalog.py`` tells the whole
lifecycle of a put).

Apart from the catalog because it is the one piece that weighs a put against every part at
once (index, sessions, placement policy, allocation, replicas, the tenant's seal key), while
publish, abort, leases and recovery only update tables; each part's own rules stay in its
module (``core/placement.py``, ``core/allocation.py``, ``core/replicas.py``).
"""

from __future__ import annotations

import numpy as np

from flatcake_ray.config import StoreConfig
from flatcake_ray.core.allocation import Allocation
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.index import PageIndex, unpack_location
from flatcake_ray.core.layout import SegmentLayout, check_pages_for
from flatcake_ray.core.placement import Placement, PlacementInputs, PlacementRule
from flatcake_ray.core.put_checks import check_segment_pages, check_session_id, put_refusal
from flatcake_ray.core.records import Ids, PutHints, PutPlan, Scope, Segment, Session, SessionId
from flatcake_ray.core.replicas import Replicas
from flatcake_ray.core.scopes import ScopeTable
from flatcake_ray.core.usage import MediaUse
from flatcake_ray.errors import QuotaExceededError

__all__ = ["PutPlanning"]


class PutPlanning:
    config: StoreConfig
    tenant: str
    seal_key: bytes | None
    policy: PlacementRule
    index: PageIndex
    segments: dict[int, Segment]
    sessions: dict[SessionId, Session]
    use: MediaUse
    scope_table: ScopeTable
    allocation: Allocation
    replicas: Replicas
    _ids: Ids
    _forks: int

    # ---- the write path ------------------------------------------------------------------
    def plan_put(
        self,
        digests: np.ndarray,
        *,
        session_id: SessionId | None = None,
        parent: np.ndarray | None = None,
        hints: PutHints | None = None,
    ) -> PutPlan | None:
        """Place and allocate the absent pages of ``digests``; None when all are stored."""
        if session_id is not None:
            session_id = check_session_id(session_id)
        check_segment_pages(len(digests))  # before the lookup: a bound on the work it does
        hints = hints or PutHints()
        found, values = self.index.lookup(digests)
        self._touch_used(values[found])
        new_positions = np.flatnonzero(~found)
        if not new_positions.size:
            return None
        matched = int(new_positions[0])
        anchor = values[matched - 1 : matched] if matched else self._parent_value(parent)
        session, refcount, parent_segment = self._resolve_session(session_id, anchor)
        turn = hints.turn or session.turns + 1
        appended_tokens = len(new_positions) * self.config.placement.page_tokens
        context = (
            hints.context_tokens
            or (max(matched, session.context_pages) + len(new_positions))
            * self.config.placement.page_tokens
        )
        reply = hints.prior_reply_tokens
        if reply is None:
            reply = self.policy.infer_prior_reply(turn, appended_tokens)
        if refcount > 1:
            self._forks += 1
        # The inferred refcount belongs to the stored page this put forks from, not to the
        # new pages: using it for them sent nearly every Mooncake conversation (all fork off
        # the system prompt) to DRAM as "shared" and cost 5.5 points of hit rate in the
        # Mooncake replay (measured when the rule was written). Only the engine knows that the
        # pages being written are shared (its radix-tree refcount), so only its hint fires the
        # shared rule.
        inputs = PlacementInputs(hints.prefix_refcount or 1, turn, reply, context)
        layout = self.layout_for(len(new_positions))
        headroom = self.allocation.dram_headroom(layout.nbytes)
        placement = self.policy.decide(inputs, dram_headroom=headroom)
        ahead = turn > 1
        scope, offset = self.allocation.allocate(session, placement.medium, layout.nbytes, ahead)
        rule = placement.rule
        tried = [placement.medium]
        if scope is None and placement.medium is Medium.DRAM:
            rule = "spill"
            scope, offset = self.allocation.allocate(session, Medium.SSD, layout.nbytes, ahead)
            tried.append(Medium.SSD)
        if scope is None:
            over = [m for m in tried if not self.use.within_quota(m, layout.nbytes)]
            if over:
                raise QuotaExceededError(
                    f"tenant {self.tenant}: a put of {layout.nbytes} bytes does not fit its "
                    f"quota on {' or '.join(m.name for m in over)} even after reclaiming its "
                    "own unreferenced scopes; nothing of another tenant was evicted"
                )
            raise put_refusal(layout, {m: self.use.space[m] for m in tried})
        scope.refs += 1  # an in-flight write pins its scope
        segment = Segment(
            next(self._ids), scope.scope_id, scope.medium, offset, layout, digests[new_positions]
        )
        segment.sealed = self._seals(scope)
        replica = None
        if self.policy.replicate(Placement(scope.medium, rule)):
            replica = self.replicas.plan(scope, segment)
        return PutPlan(
            segment, new_positions, session.session_id, rule, turn, parent_segment, replica
        )

    def _seals(self, scope: Scope) -> bool:
        """Whether a new segment of ``scope`` is written sealed: SSD pages of a tenant whose
        key is known, in a scope of sealed segments only (one written plain before stays
        readable beside the new ones: a scope is sealed whole or not at all)."""
        if self.seal_key is None or scope.medium is not Medium.SSD:
            return False
        return all(self.segments[s].sealed for s in scope.segments if s in self.segments)

    def _touch_used(self, values: np.ndarray) -> None:
        """A put's stored pages were just used by the engine (from its own cache, maybe, so
        no lease saw them): their scopes become the most recently used. Without this the
        replicas of a prefix the engine kept in HBM aged out while it was in use, and were
        gone when HBM later dropped it (agentic, DRAM above the working set, 1 QPS: 0.3% of
        hits from SSD where a tiered DRAM, touched on every write-through, had none)."""
        for segment_id in np.unique(unpack_location(values)[0]).tolist():
            segment = self.segments[segment_id]
            self.scope_table.touch(self.scope_table.by_id[segment.scope_id], 0)
            if segment.replica is not None:
                self.scope_table.touch(self.scope_table.by_id[segment.replica.scope_id], 0)

    def layout_for(self, pages: int) -> SegmentLayout:
        config = self.config
        check_pages = check_pages_for(config.check_bytes, config.page_bytes)
        return SegmentLayout(pages, config.layers, config.page_bytes, check_pages)

    def _parent_value(self, parent: np.ndarray | None) -> np.ndarray:
        if parent is None:
            return np.zeros(0, dtype=np.uint64)
        found, values = self.index.lookup(parent)
        return values[found]

    def _resolve_session(
        self, session_id: SessionId | None, anchor: np.ndarray
    ) -> tuple[Session, int, int | None]:
        """The session a put belongs to, the refcount of its prefix, the segment it continues."""
        parent_segment = None
        refcount = 1
        inherited = None
        if anchor.size:
            seg_ids, pages = unpack_location(anchor)
            segment = self.segments[int(seg_ids[0])]
            parent_segment = segment.segment_id
            at_tail = int(pages[0]) == segment.layout.pages - 1
            refcount = 1 + (segment.continuations if at_tail else 1)
            if at_tail:
                segment.continuations += 1
            inherited = self.scope_table.by_id[segment.scope_id].session_id
        if session_id is not None:
            return (
                self.sessions.setdefault(session_id, Session(session_id)),
                refcount,
                parent_segment,
            )
        if inherited is not None and refcount == 1:
            return self.sessions[inherited], refcount, parent_segment
        new_id = f"auto-{next(self._ids)}"
        session = self.sessions.setdefault(new_id, Session(new_id))
        if inherited is not None:  # a fork carries its parent's context length
            session.context_pages = self.sessions[inherited].context_pages
        return session, refcount, parent_segment
