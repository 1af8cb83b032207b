"""The node's own media as a restore :class:`~flatcake_ray.restore.source.Source`.

DRAM pages are read in place from the arena (mapped); SSD pages are read from the pool files
with O_DIRECT into the pipeline's aligned slots, the coalesced reads exactly as the plan made
them (or, where GPUDirect Storage is on and the destination is a GPU, through kvikio straight
into the slot's device twin). Releasing a restore's lease accounts its reads in the store's
counters and quarantines the scopes whose checksums failed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from flatcake_ray.config import ALIGN
from flatcake_ray.core.catalog import Catalog, Lease
from flatcake_ray.core.chunks import SlotRead
from flatcake_ray.core.gva import MAX_OFFSET, Medium
from flatcake_ray.core.keys import KeyLike, PageKey
from flatcake_ray.core.parts import lease_parts
from flatcake_ray.core.plan import MediumAccess
from flatcake_ray.errors import TransferError
from flatcake_ray.failpoints import failpoint
from flatcake_ray.media.arena import DramArena
from flatcake_ray.media.pool import SsdPool
from flatcake_ray.metrics.record import Metrics
from flatcake_ray.node.read_ledger import ReadLedger
from flatcake_ray.restore.source import FillStats, Leased, MappedView, ReadOutcome, Slot, Source
from flatcake_ray.transports.base import LOCAL_DRAM, LOCAL_SSD, ReadBatch
from flatcake_ray.transports.local_ssd import LocalSsdTransport, gds_reader


class NodeStore(Protocol):
    """What a node source asks of its store (:class:`~flatcake_ray.node.store.FlatCakeStore`):
    the media it reads, leases to pin what it reads, and where its reads are accounted."""

    @property
    def arena(self) -> DramArena: ...

    @property
    def pool(self) -> SsdPool: ...

    @property
    def metrics(self) -> Metrics: ...

    def lease(
        self, keys: Sequence[KeyLike | PageKey], *, namespace: str | None, tenant: str
    ) -> Lease: ...

    def release(self, lease: Lease) -> bool: ...

    @property
    def reads(self) -> ReadLedger: ...


class NodeSource(Source):
    fills_dram = False

    def __init__(self, store: NodeStore, catalog: Catalog) -> None:
        """The pages of one tenant (``catalog``) of ``store``."""
        self._store = store
        self._catalog = catalog
        config = catalog.config
        self.layers, self.page_bytes = config.layers, config.page_bytes
        self._ssd = LocalSsdTransport(store.pool)
        self._gds = gds_reader(config.gds, store.pool.paths, store.pool.file_bytes)
        self._access = {
            Medium.DRAM: MediumAccess(True, config.verify_dram, MAX_OFFSET + 1),
            Medium.SSD: MediumAccess(False, True, store.pool.file_bytes, ALIGN, config.gap_bytes),
        }

    @property
    def seal_key(self) -> bytes | None:
        return self._catalog.seal_key

    def lease(self, keys: Sequence[KeyLike | PageKey], namespace: str | None) -> Leased:
        lease = self._store.lease(keys, namespace=namespace, tenant=self._catalog.tenant)
        return Leased(lease.hits, lease_parts(lease), lease)

    def access(self, leased: Leased, medium: Medium) -> MediumAccess:
        return self._access[medium]

    def view(self, leased: Leased, medium: Medium) -> MappedView:
        return MappedView(self._store.arena.view, LOCAL_DRAM)

    def fill(
        self, leased: Leased, medium: Medium, reads: Sequence[SlotRead], slot: Slot
    ) -> FillStats:
        try:
            failpoint("source.fill", medium=medium)
        except OSError as exc:
            raise TransferError(f"reading the SSD pool: {exc}") from exc
        batch = ReadBatch(
            [r.src for r in reads], [r.length for r in reads], [r.slot_offset for r in reads]
        )
        if self._gds is not None and slot.device is not None and self.seal_key is None:
            stats = self._gds.read(batch, slot.device)
            return FillStats(stats.path, stats.bytes, stats.commands, stats.seconds, on_device=True)
        started = time.perf_counter()
        assert slot.host is not None  # a window's slots always have host bytes
        stats = self._ssd.read(batch, slot.host)
        return FillStats(LOCAL_SSD, stats.bytes, stats.commands, time.perf_counter() - started)

    def release(self, leased: Leased, outcome: ReadOutcome) -> int:
        self._store.reads.account(outcome, self._catalog)
        self._store.metrics.restore_ended(
            leased.parts, outcome, outcome.pages, self._catalog.tenant
        )
        self._store.release(leased.token)
        return outcome.pages

    def close(self) -> None:
        self._ssd.close()
        if self._gds is not None:
            self._gds.close()
