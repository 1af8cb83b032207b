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
catalog itself owns the index, sessions, segments and leases: lookups, publish, abort and
recovery are here, and the put's plan in :class:`~flatcake_ray.core.put_planning.PutPlanning`
(mixed in, ``core/put_planning.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from flatcake_ray.config import StoreConfig
from flatcake_ray.core.allocation import Allocation
from flatcake_ray.core.extents import MediumSpace
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.index import PageIndex, pack_location, unpack_location
from flatcake_ray.core.placement import PlacementPolicy, PlacementRule
from flatcake_ray.core.put_planning import PutPlanning
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


class Catalog(PutPlanning):
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
