"""The store's metadata: sessions, scopes, segments, the page index, space and reclamation.

No bytes move here. The live store (``store.py``) pairs a catalog with real media; the replay
model pairs one with modeled devices and a virtual clock. Not thread-safe: callers serialise.

Lifecycle of a put: :meth:`Catalog.plan_put` resolves the session, places the batch (paper
Table 2), allocates its segment (the address exists before the write) and pins the scope;
an SSD segment may also get a DRAM read replica (``core/placement.py``), allocated from DRAM
that no home scope needs; the caller writes the bytes (to both places); :meth:`Catalog.publish`
then makes the keys visible, or :meth:`Catalog.abort` gives the space back. A reader takes a
:class:`Lease` (scope refcounts up; a segment with a live replica is handed out as its
replica) and releases it; reclamation frees only unreferenced scopes, oldest first, whole.
DRAM reclamation drops replica scopes (no write-back: the SSD copy stays) before any home
scope.

The catalog holds its parts, each an object with its own state that is handed the tables it
works on: :class:`~flatcake_ray.core.scopes.ScopeTable` (scopes and their age orders),
:class:`~flatcake_ray.core.usage.MediaUse` (bytes used against quota or medium),
:class:`~flatcake_ray.core.allocation.Allocation` (a session's scope, room in its run,
quotas), :class:`~flatcake_ray.core.reclamation.Reclamation` (who goes first, freeing and
quarantine) and :class:`~flatcake_ray.core.replicas.Replicas` (DRAM read replicas). The
catalog itself owns the index, sessions, segments and leases: lookups, the put's plan,
publish, abort and recovery are here.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from flatcake_ray.config import StoreConfig
from flatcake_ray.core.allocation import Allocation
from flatcake_ray.core.extents import MediumSpace
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.index import PageIndex, pack_location, unpack_location
from flatcake_ray.core.layout import SegmentLayout, check_pages_for
from flatcake_ray.core.placement import (
    Placement,
    PlacementInputs,
    PlacementPolicy,
    PlacementRule,
)
from flatcake_ray.core.put_checks import check_segment_pages, check_session_id, put_refusal
from flatcake_ray.core.reclamation import Reclamation
from flatcake_ray.core.records import (
    Ids,
    Lease,
    PutHints,
    PutPlan,
    Scope,
    Segment,
    Session,
    SessionId,
)
from flatcake_ray.core.replicas import Replicas
from flatcake_ray.core.scopes import ScopeTable
from flatcake_ray.core.tenants import DEFAULT_TENANT
from flatcake_ray.core.usage import MediaUse
from flatcake_ray.errors import QuotaExceededError

__all__ = [
    "Catalog",
    "Ids",
    "Lease",
    "PutHints",
    "PutPlan",
    "Scope",
    "Segment",
    "Session",
    "media_spaces",
]


def media_spaces(config: StoreConfig) -> dict[Medium, MediumSpace]:
    """A store's two media, as allocation spaces (shared by its tenants' catalogs)."""
    files = config.ssd_files_per_dir * len(config.ssd_folders)
    return {
        Medium.DRAM: dram_space(config),
        Medium.SSD: MediumSpace(config.ssd_file_bytes, files, config.ssd_min_run_bytes),
    }


def dram_space(config: StoreConfig) -> MediumSpace:
    """The arena as ``config.dram_chunks`` regions; more than one: owned, a region (a chunk,
    its own file) holding one tenant's pages at a time (``media/arena.py``)."""
    chunk = config.dram_chunk_bytes
    count = -(-config.dram_bytes // chunk) if chunk else 0
    return MediumSpace(chunk, count, 4096, total=config.dram_bytes, owned=count > 1)


class Catalog:
    """One tenant's pages on a store's media. ``space`` and ``ids`` are shared by the catalogs
    of one store (one per tenant); ``quota`` bounds the bytes this tenant's scopes reserve per
    medium; ``on_free`` hears of every home scope freed (the store logs SSD frees). A catalog
    reclaims only its own scopes: a tenant over its quota, or a medium above its high
    watermark, frees this tenant's oldest unreferenced scopes, never another's.
    """

    def __init__(
        self,
        config: StoreConfig,
        policy: PlacementRule | None = None,
        *,
        space: dict[Medium, MediumSpace] | None = None,
        ids: Ids | None = None,
        quota: dict[Medium, int | None] | None = None,
        tenant: str = DEFAULT_TENANT,
        on_free: Callable[[Scope], None] | None = None,
    ) -> None:
        self.config = config
        self.tenant = tenant
        # The key its SSD pages are sealed under (``core.tenants.seal_key``), once a caller
        # presenting the tenant's secret has told it; None: written plain (no secret).
        self.seal_key: bytes | None = None
        self.policy: PlacementRule = policy or PlacementPolicy(config.placement)
        self.index = PageIndex()
        self.segments: dict[int, Segment] = {}
        self.sessions: dict[SessionId, Session] = {}
        self.leases: dict[int, Lease] = {}
        self.rule_counts: dict[str, int] = {}
        self._forks = 0
        self._ids = ids if ids is not None else Ids()
        self.use = MediaUse(space if space is not None else media_spaces(config), quota)
        self.scope_table = ScopeTable(self.sessions)
        self.replicas = Replicas(
            config, self.use.space[Medium.DRAM], self.scope_table, self.segments, self._ids, tenant
        )
        self.reclamation = Reclamation(
            self.use, self.scope_table, self.segments, self.index, self.replicas, on_free
        )
        self.allocation = Allocation(
            config, self.use, self.scope_table, self.reclamation, self._ids, tenant
        )

    # ---- what the parts hold, as the store and the replay model read it ------------------
    @property
    def scopes(self) -> dict[int, Scope]:
        return self.scope_table.by_id

    @property
    def space(self) -> dict[Medium, MediumSpace]:
        return self.use.space

    @property
    def used(self) -> dict[Medium, int]:
        return self.use.used

    @property
    def quota(self) -> dict[Medium, int | None]:
        return self.use.quota

    def set_quota(self, quota: dict[Medium, int | None]) -> None:
        self.use.quota = dict(quota)

    @property
    def counters(self) -> dict[str, int]:
        return {
            **self.reclamation.counters,
            "forks": self._forks,
            **self.replicas.counters,
        }

    def reclaim(self, medium: Medium, target: float) -> list[Scope]:
        """See :meth:`Reclamation.reclaim`."""
        return self.reclamation.reclaim(medium, target)

    def free_scope(self, scope: Scope) -> int:
        """See :meth:`Reclamation.free_scope`."""
        return self.reclamation.free_scope(scope)

    def quarantine(self, scope_id: int) -> None:
        """See :meth:`Reclamation.quarantine`."""
        self.reclamation.quarantine(scope_id)

    # ---- lookups -------------------------------------------------------------------------
    def prefix(self, digests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(segment ids, pages in segment) of the consecutive hits from the first key."""
        found, values = self.index.lookup(digests)
        misses = np.flatnonzero(~found)
        hits = int(misses[0]) if misses.size else len(digests)
        return unpack_location(values[:hits])

    def reads_ssd(self, segment_ids: np.ndarray) -> bool:
        """Whether a read of these segments touches SSD: a segment with a live DRAM replica
        is read from the replica (as :meth:`lease` hands it out)."""
        for segment_id in np.unique(segment_ids).tolist():
            segment = self.segments[segment_id]
            if (segment.replica or segment).medium is Medium.SSD:
                return True
        return False

    def lease(self, digests: np.ndarray) -> Lease:
        segment_ids, pages = self.prefix(digests)
        segments: dict[int, Segment] = {}
        scope_ids: set[int] = set()
        for segment_id in np.unique(segment_ids).tolist():
            segment = self.segments[segment_id]
            view = segment.replica or segment  # readers prefer the DRAM replica
            segments[segment_id] = view
            scope_ids.update((segment.scope_id, view.scope_id))  # both pinned while read
        for scope_id in sorted(scope_ids):
            self.scope_table.touch(self.scopes[scope_id], +1)
        pinned = tuple(sorted(scope_ids))
        lease = Lease(next(self._ids), segment_ids, pages, pinned, segments, self.tenant)
        self.leases[lease.lease_id] = lease
        return lease

    def release(self, lease: Lease) -> None:
        if self.leases.pop(lease.lease_id, None) is None:
            return
        for scope_id in lease.scope_ids:
            scope = self.scopes.get(scope_id)
            if scope is not None:
                scope.refs -= 1

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
            raise put_refusal(layout, {m: self.space[m] for m in tried})
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
            self.scope_table.touch(self.scopes[segment.scope_id], 0)
            if segment.replica is not None:
                self.scope_table.touch(self.scopes[segment.replica.scope_id], 0)

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
            inherited = self.scopes[segment.scope_id].session_id
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

    # ---- publish and abort ---------------------------------------------------------------
    def publish(self, plan: PutPlan) -> np.ndarray:
        """Make a written segment's keys visible; returns the mask of pages published."""
        segment = plan.segment
        scope = self.scopes[segment.scope_id]
        scope.refs -= 1
        self.segments[segment.segment_id] = segment
        scope.segments.append(segment.segment_id)
        values = pack_location(
            np.full(segment.layout.pages, segment.segment_id), np.arange(segment.layout.pages)
        )
        inserted = self.index.insert(segment.digests, values)
        scope.pages += int(inserted.sum())
        if plan.replica is not None:
            self.replicas.publish(plan.replica, segment)
        session = self.sessions[plan.session_id]
        session.turns = max(session.turns, plan.turn)
        session.context_pages += segment.layout.pages
        self.rule_counts[plan.rule] = self.rule_counts.get(plan.rule, 0) + 1
        self.scope_table.touch(scope, 0)
        return inserted

    def abort(self, plan: PutPlan) -> None:
        """Give back an unwritten segment's space (exactly when it is still the run's tail)."""
        if plan.parent_segment in self.segments:
            parent = self.segments[plan.parent_segment]
            parent.continuations = max(0, parent.continuations - 1)
        if plan.replica is not None:
            self.allocation.give_back(plan.replica)
        self.allocation.give_back(plan.segment)

    # ---- recovery ------------------------------------------------------------------------
    def adopt_scope(
        self, scope_id: int, session_id: SessionId, runs: list[list[int]], segments: list[Segment]
    ) -> None:
        """Re-create an SSD scope from the manifest (a restarted node)."""
        scope = Scope(scope_id, session_id, Medium.SSD)
        space = self.space[Medium.SSD]
        for _allocator, start, length, used in runs:
            space.reserve(scope.runs, start, length, used)
        self.used[Medium.SSD] += scope.runs.used_bytes
        self.scope_table.add(scope)
        session = self.sessions.setdefault(session_id, Session(session_id))
        session.scopes[Medium.SSD] = scope_id
        for segment in segments:
            self.segments[segment.segment_id] = segment
            scope.segments.append(segment.segment_id)
            values = pack_location(
                np.full(segment.layout.pages, segment.segment_id), np.arange(segment.layout.pages)
            )
            scope.pages += int(self.index.insert(segment.digests, values).sum())
            session.turns += 1
            session.context_pages += segment.layout.pages
        if not segments:  # a quarantined scope: space held, nothing readable
            self.scope_table.drop(scope)

    def skip_ids_below(self, floor: int) -> None:
        self._ids.skip_below(floor)
