"""FlatCake storage in the model: the live :class:`Catalog` with modelled devices.

The catalog's bytes never exist: a put is :meth:`Catalog.plan_put` when the prefill starts
(layer-wise saves) and :meth:`Catalog.publish` when the modelled write completes (the live
store's order: address first, key visible only after the write). A lookup is
:meth:`Catalog.lease`, held until the request's restore ends (its prefill starts, before its
put is planned), as the live pipeline releases it. SSD reads are those of the live restore
pipeline's own plan (:class:`~flatcake_ray.core.plan.RestorePlan`: the wanted checksum blocks
of each layer, coalesced group by group, reads capped at a staging slot); a read longer than
a slot is cut into slot-sized commands, as the pipeline streams it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from flatcake_ray.config import ALIGN, PlacementConfig, StoreConfig
from flatcake_ray.core.catalog import Catalog
from flatcake_ray.core.gva import MEDIA_SHIFT, Medium
from flatcake_ray.core.parts import LeasePart, lease_parts
from flatcake_ray.core.placement import Placement, PlacementInputs, PlacementPolicy
from flatcake_ray.core.plan import MediumAccess, RestorePlan
from flatcake_ray.core.runs import align_up
from flatcake_ray.errors import MediumFullError
from flatcake_ray.replay.pages import TracePages, put_hints
from flatcake_ray.replay.profiles import Profile
from flatcake_ray.replay.systems import Located, StorageCounters, SystemSpec, Transfer


class OraclePlacement:
    """A stand-in for :class:`PlacementPolicy` that the model tells, before each put, where
    the put goes (it knows the trace's future). Passed to the Catalog as its policy."""

    def __init__(self, config: PlacementConfig) -> None:
        self._inner = PlacementPolicy(config)
        self.pending = Placement(Medium.SSD, "oracle-ssd")

    def decide(self, inputs: PlacementInputs, **room: bool) -> Placement:
        return self.pending

    def replicate(self, home: Placement) -> bool:
        return False  # the oracle puts a page where it will be read; it needs no copies

    def infer_prior_reply(self, turn: int, appended_tokens: int) -> int | None:
        return self._inner.infer_prior_reply(turn, appended_tokens)


def store_config_for(
    profile: Profile, placement: PlacementConfig, pages: TracePages
) -> StoreConfig:
    """A per-rank store: pool files sized so the largest request's segment fits one file."""
    largest_pages = int(np.diff(pages.offsets).max()) if len(pages) else 1
    largest_segment = profile.layers * align_up(max(largest_pages, 1) * profile.page_bytes)
    ssd = profile.ssd_rank_bytes
    file_bytes = min(align_up(max(2 * largest_segment, ssd // 256, ALIGN)), max(ssd, ALIGN))
    return StoreConfig(
        root="replay-model",  # never touched: the catalog needs no files
        layers=profile.layers,
        page_bytes=profile.page_bytes,
        dram_bytes=profile.dram_rank_bytes,
        ssd_file_bytes=file_bytes // ALIGN * ALIGN,
        ssd_files_per_dir=max(1, ssd // file_bytes),
        ssd_min_run_bytes=max(ALIGN, min(1 << 20, file_bytes) // ALIGN * ALIGN),
        fsync=False,
        hugepages="off",
        placement=placement,
    )


class FlatStorage:
    saves_during_prefill = True
    keeps_restored = True

    def __init__(
        self,
        profile: Profile,
        spec: SystemSpec,
        pages: TracePages,
        placement: PlacementConfig,
        arrivals: np.ndarray,
        config: StoreConfig | None = None,
    ) -> None:
        self.profile = profile
        self.spec = spec
        self.pages = pages
        self.arrivals = arrivals
        # ``config``: a given node's store (the live replay compares against one); by
        # default one sized from the profile.
        self.config = config or store_config_for(profile, placement, pages)
        self.oracle = OraclePlacement(placement) if spec.oracle else None
        self.catalog = Catalog(self.config, policy=self.oracle)
        self.counters = StorageCounters()
        self.media_at_publish: dict[int, tuple[Medium, int]] = {}  # segment -> (medium, offset)
        self.ssd_access = MediumAccess(
            False, True, self.config.ssd_file_bytes, ALIGN, self.config.gap_bytes
        )

    # ---- reads ---------------------------------------------------------------------------
    def locate(self, request: int, digests: np.ndarray, start: int) -> Located:
        lease = self.catalog.lease(digests[start:])
        self.counters.add("leases")
        if lease.hits == 0:
            self.catalog.release(lease)
            return Located(np.zeros(0, dtype=np.int8), np.zeros(0, dtype=np.uint64))
        unique, inverse = np.unique(lease.segment_ids, return_inverse=True)
        segments = [lease.segments[int(s)] for s in unique]
        media = np.array([int(s.medium) for s in segments], dtype=np.int8)[inverse]
        bases = np.array([s.offset for s in segments], dtype=np.uint64)[inverse]
        node = np.uint64(self.config.node_id << 48)
        gvas = (
            (media.astype(np.uint64) << np.uint64(MEDIA_SHIFT))
            | node
            | (bases + lease.pages.astype(np.uint64) * np.uint64(self.profile.page_bytes))
        )
        self._check_never_moved(unique.tolist())
        return Located(media, gvas, lease)

    def ssd_reads(self, located: Located) -> np.ndarray:
        """Byte lengths of the SSD read commands the live pipeline would issue for the pages
        the request does not have yet."""
        parts = [p for p in lease_parts(located.handle) if p.medium is Medium.SSD]
        if located.have is not None:
            parts = [p for p in (_without(p, located.have) for p in parts) if p.pages]
        if not parts:
            return np.zeros(0, dtype=np.int64)
        plan = RestorePlan(parts, self.profile.slot_bytes, {Medium.SSD: self.ssd_access})
        lengths = [plan.reads(first, end, Medium.SSD).lengths for first, end in plan.groups]
        return split_to_slots(np.concatenate(lengths), self.profile.slot_bytes)

    def release(self, request: int, located: Located, used: slice) -> list[Transfer]:
        lease = located.handle
        if lease is not None:
            if used.stop > used.start:
                self.counters.add("replica_hit_pages", self._replica_pages(lease, used))
            self.catalog.release(lease)
        return []

    def _replica_pages(self, lease: Any, used: slice) -> int:
        replicas = [s for s, v in lease.segments.items() if v.scope_id != self._home_scope(s)]
        return int(np.isin(lease.segment_ids[used], replicas).sum()) if replicas else 0

    def _home_scope(self, segment_id: int) -> int:
        return self.catalog.segments[segment_id].scope_id

    # ---- writes --------------------------------------------------------------------------
    def store(self, request: int, digests: np.ndarray, now: float) -> list[Transfer]:
        if self.oracle is not None:
            digests = self._oracle_choice(request, digests, now)
            if not len(digests):
                return []
        try:
            session, hints = self.pages.session_of(request), put_hints(self.pages, request)
            plan = self.catalog.plan_put(digests, session_id=session, hints=hints)
        except MediumFullError:
            self.counters.add("puts_failed")
            return []
        if plan is None:
            return []
        layout = plan.segment.layout
        self.counters.add("puts_planned")
        if self.oracle is None:
            self._score_against_oracle(request, plan, now)
        if plan.segment.medium is Medium.DRAM:
            return [Transfer("d2h", np.array([layout.nbytes]), plan, medium=Medium.DRAM)]
        lengths = np.full(layout.layers, layout.layer_stride, dtype=np.int64)
        transfers = [Transfer("ssd-write", lengths, plan, plan.segment.digests)]
        if plan.replica is not None:  # the bytes land in DRAM on their way to the drive
            self.counters.add("pages_replicated", len(plan.new_positions))
            transfers.insert(0, Transfer("d2h", np.array([layout.nbytes]), medium=Medium.DRAM))
        return transfers

    def complete(self, transfer: Transfer) -> None:
        plan = transfer.token
        self.catalog.publish(plan)
        self.counters.add("puts_published")
        self.counters.add(f"pages_to_{plan.segment.medium.name.lower()}", len(plan.new_positions))
        self.media_at_publish[plan.segment.segment_id] = (plan.segment.medium, plan.segment.offset)

    def _oracle_choice(self, request: int, digests: np.ndarray, now: float) -> np.ndarray:
        first = self.pages.offsets[request]
        next_use = self.pages.next_use[first : first + len(digests)]
        reused = np.flatnonzero(next_use >= 0)
        assert self.oracle is not None  # only the oracle system asks
        if not reused.size:
            self.counters.add("oracle_skipped_puts")
            return digests[:0]
        keep = int(reused[-1]) + 1  # pages after the last reused one are never read again
        soonest = float(self.arrivals[next_use[reused].min()]) - now
        # DRAM only while it stays under the low watermark: past it the catalog would reclaim
        # whole scopes, and an oracle does not throw away pages it knows are coming back.
        dram = self.catalog.space[Medium.DRAM]
        nbytes = keep * self.profile.page_all_layers_bytes
        room = dram.capacity and (
            dram.used_fraction + nbytes / dram.capacity <= self.config.low_watermark
        )
        near = soonest <= self.spec.oracle_horizon_s and bool(room)
        self.oracle.pending = Placement(
            Medium.DRAM if near else Medium.SSD, "oracle-dram" if near else "oracle-ssd"
        )
        return digests[:keep]

    def _score_against_oracle(self, request: int, plan: Any, now: float) -> None:
        """Count the put's pages that sit where the oracle would not put them: homed on DRAM
        but not read again within the oracle's horizon, or only on SSD (no replica) though
        read again within it. Pages never read again are counted apart (the oracle does not
        store them at all)."""
        first = self.pages.offsets[request]
        next_use = self.pages.next_use[first + plan.new_positions]
        reused = next_use >= 0
        soon = np.zeros(len(next_use), dtype=bool)
        soon[reused] = self.arrivals[next_use[reused]] - now <= self.spec.oracle_horizon_s
        in_dram = plan.segment.medium is Medium.DRAM
        dram_copy = in_dram or plan.replica is not None
        self.counters.add("pages_scored", len(next_use))
        self.counters.add("pages_never_reused", int((~reused).sum()))
        self.counters.add("pages_dram_not_soon", int((~soon).sum()) if in_dram else 0)
        self.counters.add("pages_ssd_only_soon", 0 if dram_copy else int(soon.sum()))

    def _check_never_moved(self, segment_ids: list[int]) -> None:
        for segment_id in segment_ids:
            segment = self.catalog.segments[segment_id]  # the home copy, not a replica
            known = self.media_at_publish.get(segment_id)
            if known is not None and known != (segment.medium, segment.offset):
                self.counters.add("migrations")

    def report(self) -> dict[str, Any]:
        catalog = self.catalog
        return {
            **self.counters.values,
            **{f"catalog_{k}": v for k, v in catalog.counters.items()},
            "catalog_rules": dict(catalog.rule_counts),
            "catalog_sessions": len(catalog.sessions),
            "catalog_scopes": len(catalog.scopes),
            "catalog_pages_indexed": len(catalog.index),
            "dram_used_fraction": catalog.space[Medium.DRAM].used_fraction,
            "ssd_used_fraction": catalog.space[Medium.SSD].used_fraction,
            "leases_open": len(catalog.leases),
        }


def split_to_slots(lengths: np.ndarray, slot_bytes: int) -> np.ndarray:
    """Cut reads longer than a slot into slot-sized commands (plus the remainder)."""
    pieces = -(-lengths // slot_bytes)
    if (pieces <= 1).all():
        return lengths
    out = np.repeat(np.minimum(lengths, slot_bytes), pieces)
    last = np.cumsum(pieces) - 1
    out[last] = lengths - (pieces - 1) * slot_bytes
    return out


def _without(part: LeasePart, have: np.ndarray) -> LeasePart:
    """``part`` less the pages whose request positions ``have`` marks."""
    keep = ~have[part.dst_positions]
    if keep.all():
        return part
    return dataclasses.replace(
        part, src_pages=part.src_pages[keep], dst_positions=part.dst_positions[keep]
    )
