"""What a node's restores found, kept in its store: bytes and commands per medium and pages
delivered (the store's counters), and the scopes whose checksums failed, quarantined (on
SSD also in the manifest, so a restart keeps them out). ``NodeSource.release`` hands it each
restore's outcome; a remote reader that saw a bad block has the node read those scopes again
through it (``recheck``), so a bad medium is quarantined here and a torn remote read is not.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from flatcake_ray.core.catalog import Catalog, Lease
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.parts import lease_parts
from flatcake_ray.cuda_ext.layouts import LAYER_FIRST
from flatcake_ray.node.manifest import Manifest
from flatcake_ray.restore.source import Leased, ReadOutcome

if TYPE_CHECKING:
    from flatcake_ray.restore.pipeline import RestorePipeline


class ReadLedger:
    def __init__(self, lock: threading.RLock, counters: dict[str, int], manifest: Manifest) -> None:
        """``lock``, ``counters`` and ``manifest``: the store's own."""
        self._lock = lock
        self._counters = counters
        self._manifest = manifest

    def account(self, outcome: ReadOutcome, catalog: Catalog) -> None:
        """Count a restore's reads and quarantine the scopes whose checksums failed."""
        config = catalog.config
        counters = self._counters
        with self._lock:
            counters["ssd_read_commands"] += outcome.commands.get(Medium.SSD, 0)
            counters["ssd_bytes_read"] += outcome.bytes_read.get(Medium.SSD, 0)
            counters["dram_bytes_read"] += outcome.bytes_wanted.get(Medium.DRAM, 0)
            counters["hit_pages"] += outcome.pages
            counters["bytes_delivered"] += outcome.pages * config.layers * config.page_bytes
            for scope_id in outcome.bad_scopes:
                self._quarantine(catalog, scope_id)

    def recheck(
        self, lease: Lease, scope_ids: set[int], catalog: Catalog, pipeline: RestorePipeline
    ) -> None:
        """Read the leased pages of ``scope_ids`` again through ``pipeline`` (the store's, for
        the lease's tenant, on the host), verifying every block: a scope whose medium really
        is bad fails its check there and is quarantined by :meth:`account`. Consumes the
        lease: it is released when the re-read ends."""
        from flatcake_ray.restore.dest import PagedPool  # with the pipeline: see store_restores

        parts = [p for p in lease_parts(lease) if p.scope_id in scope_ids]
        pages = sum(p.pages for p in parts)
        renumbered, at = [], 0
        for part in parts:
            positions = np.arange(at, at + part.pages, dtype=np.int64)
            renumbered.append(part.at_positions(positions))
            at += part.pages
        config = catalog.config
        scratch = np.empty((config.layers, pages, config.page_bytes), dtype=np.uint8)
        dest = PagedPool(scratch, np.arange(pages), LAYER_FIRST)
        leased = Leased(pages, tuple(renumbered), lease)
        pipeline.submit_leased(leased, dest).wait()

    def _quarantine(self, catalog: Catalog, scope_id: int) -> None:
        scope = catalog.scopes.get(scope_id)
        if scope is None:
            return
        runs = [[r.allocator, r.start, r.length, r.used] for r in scope.runs.runs]
        self._counters["checksum_failures"] += 1
        catalog.quarantine(scope_id)
        if scope.medium is Medium.SSD:
            self._manifest.append({"t": "quarantine", "scope": scope_id, "runs": runs})
