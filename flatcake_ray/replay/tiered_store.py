"""Tiered storage in the model (recompute, dram-only, tiered, tiered-gds, tiered-tuned,
tiered-aware).

One class, switched by :class:`SystemSpec`: a DRAM :class:`PageLru` written through on every
prefill (SGLang HiCache's write-through L2), optionally backed by a :class:`FifoBucketSsd`
that receives DRAM's evictions (a page already on SSD keeps its copy and is not rewritten).
SSD reads go through the live :func:`coalesce`: page objects (host-staged path), or one
descriptor per (page, layer) submitted layer by layer (GDS path). ``tiered-aware`` swaps the
DRAM LRU for eviction and admission by predicted reuse (``aware.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flatcake_ray.config import ALIGN, StoreConfig
from flatcake_ray.core.coalesce import coalesce
from flatcake_ray.core.gva import SSD_FLOOR, Medium
from flatcake_ray.replay.aware import PredictedLru, ReusePredictor
from flatcake_ray.replay.pages import TracePages
from flatcake_ray.replay.profiles import Profile
from flatcake_ray.replay.systems import Located, StorageCounters, SystemSpec, Transfer
from flatcake_ray.replay.tiers import FifoBucketSsd, PageLru

_DEFAULTS = StoreConfig(root="replay-model", layers=1, page_bytes=1)  # gap / max read defaults


class TieredStorage:
    saves_during_prefill = False
    keeps_restored = False

    def __init__(self, profile: Profile, spec: SystemSpec, pages: TracePages) -> None:
        self.profile = profile
        self.spec = spec
        self.pages = pages
        self.object_bytes = -(-profile.page_all_layers_bytes // ALIGN) * ALIGN
        dram_pages = profile.dram_rank_bytes // self.object_bytes if spec.dram else 0
        self.predictor = ReusePredictor(len(pages.session_names))
        self.dram = (
            PredictedLru(dram_pages, self.predictor)
            if spec.dram_order == "predicted"
            else PageLru(dram_pages)
        )
        self.ssd = (
            FifoBucketSsd(profile.ssd_rank_bytes, spec.fifo_buckets, self.object_bytes)
            if spec.ssd
            else None
        )
        self.counters = StorageCounters()

    # ---- reads ---------------------------------------------------------------------------
    def locate(self, request: int, digests: np.ndarray, start: int) -> Located:
        rest = digests[start:]
        in_dram, slots = self.dram.slots(rest)
        if self.ssd is not None:
            in_ssd, where = self.ssd.lookup(rest)
        else:
            in_ssd, where = np.zeros(len(rest), dtype=bool), np.zeros((len(rest), 2), np.int64)
        missing = np.flatnonzero(~(in_dram | in_ssd))
        run = int(missing[0]) if missing.size else len(rest)
        from_dram = in_dram[:run]
        media = np.where(from_dram, int(Medium.DRAM), int(Medium.SSD)).astype(np.int8)
        pinned = slots[:run][from_dram]
        self.dram.pin(pinned, +1)  # DRAM hits stay until the prefill has them
        self.dram.touch(pinned)
        ssd_rows = np.flatnonzero(~from_dram)
        pool = where[:run][ssd_rows]
        gvas = np.where(
            from_dram,
            slots[:run].astype(np.uint64) * np.uint64(self.object_bytes),
            np.uint64(SSD_FLOOR),
        ).astype(np.uint64)
        handle = {"pinned": pinned, "ssd_digests": rest[:run][ssd_rows], "ssd_where": pool}
        return Located(media, gvas, handle)

    def ssd_reads(self, located: Located) -> np.ndarray:
        return self._read_lengths(located.handle["ssd_where"])

    def _read_lengths(self, where: np.ndarray) -> np.ndarray:
        if not len(where) or self.ssd is None:
            return np.zeros(0, dtype=np.int64)
        buckets, offsets = where[:, 0], where[:, 1]
        if self.spec.ssd_read == "page-layer":
            layers = self.profile.layers
            layer = np.tile(np.arange(layers), len(where))
            files = layer * self.ssd.buckets + np.repeat(buckets, layers)  # per-layer submission
            starts = np.repeat(offsets, layers) + layer * self.profile.page_bytes
            lengths = np.full(len(starts), self.profile.page_bytes, dtype=np.int64)
        else:
            files, starts = buckets, offsets
            lengths = np.full(len(where), self.object_bytes, dtype=np.int64)
        reads = coalesce(
            files,
            starts,
            lengths,
            gap_bytes=_DEFAULTS.gap_bytes,
            max_read_bytes=_DEFAULTS.max_read_bytes,
            align=ALIGN,
        )
        return reads.lengths

    def release(self, request: int, located: Located, used: slice) -> list[Transfer]:
        """Unpin DRAM hits; promote the SSD hits the prefill used into DRAM (re-read)."""
        if located.handle is None:
            return []
        self.dram.pin(located.handle["pinned"], -1)
        if not self.spec.promote or not self.dram.capacity:
            return []
        ssd_positions = np.flatnonzero(located.media)
        chosen = (ssd_positions >= used.start) & (ssd_positions < used.stop)
        promoted = located.handle["ssd_digests"][chosen]
        if not len(promoted):
            return []
        self.counters.add("pages_promoted", len(promoted))
        reread = self._read_lengths(located.handle["ssd_where"][chosen])
        transfers = [Transfer("ssd-read", reread)]
        return transfers + self._into_dram(promoted, request, written=False)

    # ---- writes --------------------------------------------------------------------------
    def store(self, request: int, digests: np.ndarray, now: float) -> list[Transfer]:
        session = int(self.pages.sessions[request])
        first_turn = np.isnan(self.predictor.last[session]) if session >= 0 else True
        self.predictor.observe(session, now)
        if not self.dram.capacity or not len(digests):
            return []
        if isinstance(self.dram, PredictedLru):
            self.dram.now = now
            if first_turn and not self.dram.admits_first_turn(len(digests)):
                return self._bypass_dram(digests, session)
        return self._into_dram(digests, request, written=True)

    def _bypass_dram(self, digests: np.ndarray, session: int) -> list[Transfer]:
        """Admission refused: the pages go straight to the SSD tier (if there is one)."""
        self.counters.add("pages_not_admitted", len(digests))
        if self.ssd is None:
            return []
        offsets, written = self.ssd.append(digests, np.full(len(digests), session))
        return [self._write(offsets, written)] if len(offsets) else []

    def _into_dram(self, digests: np.ndarray, request: int, written: bool) -> list[Transfer]:
        found, _ = self.dram.slots(digests)
        new = int(np.count_nonzero(~found))
        evicted, owners = self.dram.insert(digests, owner=int(self.pages.sessions[request]))
        transfers = []
        if written and new:
            transfers.append(
                Transfer("d2h", np.array([new * self.object_bytes]), medium=Medium.DRAM)
            )
        self.counters.add("dram_evictions", len(evicted))
        if self.ssd is not None and len(evicted):
            offsets, demoted = self.ssd.append(evicted, owners)
            if len(offsets):
                self.counters.add("pages_demoted", len(offsets))
                transfers.append(self._write(offsets, demoted))
        return transfers

    def _write(self, pool_offsets: np.ndarray, digests: np.ndarray) -> Transfer:
        assert self.ssd is not None  # only a system with an SSD tier writes to it
        lengths = np.full(len(pool_offsets), self.object_bytes, dtype=np.int64)
        # Objects appended together are contiguous in their bucket: one command per run.
        buckets = pool_offsets // max(self.ssd.bucket_bytes, 1)
        merged = coalesce(
            buckets, pool_offsets, lengths, gap_bytes=0, max_read_bytes=None, align=ALIGN
        )
        return Transfer("ssd-write", merged.lengths, None, digests)

    def complete(self, transfer: Transfer) -> None:
        pass  # DRAM and the SSD index change when the engine hands over the pages

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.counters.values, "dram_pages": self.dram.capacity}
        if self.ssd is not None:
            out.update({f"fifo_{k}": v for k, v in self.ssd.counters.items()})
            out["fifo_buckets"] = self.ssd.buckets
        return out
