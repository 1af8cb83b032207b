"""The write half of a node's store: a planned segment's bytes onto its medium, then publish.

The store plans a put (``Catalog.plan_put``: placement, allocation, the scope pinned) and hands
the plan to a :class:`PutHandle` (``put.py``), which calls this writer:

- ``write_pages(state, layer, first, pages)``: pages of keys ``[first, first + n)`` of one
  layer, in key order; the writer keeps those the plan writes (keys not stored yet). A DRAM
  page goes straight into the arena; an SSD layer is assembled in an aligned staging buffer
  and written with one O_DIRECT command once all its pages are in. A finished layer gets its
  per-block checksums.
- ``commit(state)``: data on the drive (fdatasync when ``fsync``), the manifest record written,
  then the keys published: a reader never sees a key whose bytes or record are not there.
- ``abort(state)``: the space goes back; nothing was published.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flatcake_ray.core.catalog import Catalog, PutPlan
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.integrity import layer_checksums
from flatcake_ray.failpoints import failpoint
from flatcake_ray.media.arena import DramArena
from flatcake_ray.media.buffers import AlignedBuffer
from flatcake_ray.media.pool import SsdPool
from flatcake_ray.node.manifest import Manifest

log = logging.getLogger(__name__)


@dataclass
class WriteState:
    """One planned segment being written."""

    plan: PutPlan
    catalog: Catalog  # the tenant's catalog the plan was made in
    keys: int  # keys of the put (pages written are the plan's new positions among them)
    received: np.ndarray  # per layer: new pages written so far
    checksums: np.ndarray  # uint64 [layers, blocks], the segment's, filled as layers finish
    staging: dict[int, AlignedBuffer] = field(default_factory=dict)  # SSD layers in progress
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pages_new(self) -> int:
        return len(self.plan.new_positions)

    def layers_missing(self) -> list[int]:
        return np.flatnonzero(self.received < self.pages_new).tolist()


class SegmentWriter:
    def __init__(
        self,
        lock: threading.RLock,
        arena: DramArena,
        pool: SsdPool,
        manifest: Manifest,
        counters: dict[str, int],
        *,
        fsync: bool,
        check_open: Callable[[], None],
    ) -> None:
        self._lock = lock  # the store's: the catalog and counters change under it
        self.arena = arena
        self.pool = pool
        self.manifest = manifest
        self.counters = counters
        self.fsync = fsync
        self._check_open = check_open

    def start(self, plan: PutPlan, catalog: Catalog, keys: int) -> WriteState:
        layers = plan.segment.layout.layers
        checksums = np.zeros((layers, plan.segment.layout.blocks), dtype=np.uint64)
        plan.segment.checksums = checksums
        return WriteState(plan, catalog, keys, np.zeros(layers, dtype=np.int64), checksums)

    def write_pages(self, state: WriteState, layer: int, first: int, pages: np.ndarray) -> None:
        """``pages``: uint8 [n, page_bytes] of keys ``[first, first + n)`` of ``layer``."""
        positions = state.plan.new_positions
        lo, hi = np.searchsorted(positions, [first, first + len(pages)])
        if lo == hi:
            return
        chosen = pages[positions[lo:hi] - first]
        failpoint("store.write_layer", layer=layer, medium=state.plan.segment.medium)
        with state.lock:
            self._place(state, layer, int(lo), chosen)
            state.received[layer] += hi - lo
            done = state.received[layer] == state.pages_new
        if done:
            self._finish_layer(state, layer)

    def _place(self, state: WriteState, layer: int, first_new: int, pages: np.ndarray) -> None:
        """Put new pages ``[first_new, first_new + n)`` of ``layer`` where they belong."""
        segment = state.plan.segment
        layout = segment.layout
        if segment.medium is Medium.DRAM:
            start = segment.offset + layout.layer_offset(layer) + first_new * layout.page_bytes
            self.arena.write(start, pages)
            return
        if layer not in state.staging:
            state.staging[layer] = AlignedBuffer(layout.layer_stride)
        at = first_new * layout.page_bytes
        state.staging[layer].array[at : at + pages.nbytes] = pages.reshape(-1)

    def _finish_layer(self, state: WriteState, layer: int) -> None:
        segment = state.plan.segment
        layout = segment.layout
        start = segment.offset + layout.layer_offset(layer)
        if segment.medium is Medium.DRAM:
            extent = self.arena.view[start : start + layout.layer_bytes]
            state.checksums[layer] = layer_checksums(extent, layout)
            self._count(dram_bytes_written=layout.layer_bytes)
            return
        staging = state.staging.pop(layer)
        replica = state.plan.replica  # a DRAM read replica of the same bytes (placement.py)
        try:
            staging.array[layout.layer_bytes : layout.layer_stride] = 0
            state.checksums[layer] = layer_checksums(staging.array, layout)
            self.pool.write(start, staging.array[: layout.layer_stride])
            if replica is not None:
                self.arena.write(
                    replica.offset + layout.layer_offset(layer), staging.array[: layout.layer_bytes]
                )
        finally:
            staging.close()
        self._count(ssd_bytes_written=layout.layer_stride, ssd_write_commands=1)
        if replica is not None:
            self._count(dram_bytes_written=layout.layer_bytes)

    def commit(self, state: WriteState) -> np.ndarray:
        """Make the segment durable and its keys visible; returns the mask published."""
        plan = state.plan
        segment = plan.segment
        if segment.medium is Medium.SSD and self.fsync:
            self.pool.sync(segment.offset)
        with self._lock:
            self._check_open()
            recorded = False
            try:
                if segment.medium is Medium.SSD:
                    self.manifest.append(self._record(state))
                    recorded = True
                failpoint("store.publish", segment=segment.segment_id)
                published = state.catalog.publish(plan)
            except BaseException:
                if recorded:  # the put is aborted: a restart must not bring the segment back
                    self._retract(segment.scope_id, segment.segment_id)
                raise
            self.counters["puts"] += 1
        return published

    def _retract(self, scope_id: int, segment_id: int) -> None:
        try:
            self.manifest.append({"t": "unseg", "scope": scope_id, "segment": segment_id})
        except OSError:
            # The record stays: at restart its checksums (and the overlap check against the
            # scope that reuses the space) keep its stale bytes from ever being delivered.
            log.exception("could not retract segment %d from the manifest", segment_id)

    def _record(self, state: WriteState) -> dict[str, Any]:
        segment = state.plan.segment
        scope = state.catalog.scopes[segment.scope_id]
        return {
            "t": "seg",
            "scope": scope.scope_id,
            "session": scope.session_id,
            "segment": segment.segment_id,
            "offset": segment.offset,
            "pages": segment.layout.pages,
            "digests": segment.digests.tobytes(),
            "checksums": state.checksums.tobytes(),
            "runs": [[r.allocator, r.start, r.length, r.used] for r in scope.runs.runs],
            "tenant": state.catalog.tenant,
            "layers": segment.layout.layers,
            "page_bytes": segment.layout.page_bytes,
            "check_pages": segment.layout.check_pages,
        }

    def abort(self, state: WriteState) -> None:
        with state.lock:
            for staging in state.staging.values():
                staging.close()
            state.staging.clear()
        with self._lock:
            state.catalog.abort(state.plan)
            self.counters["write_failures"] += 1

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self.counters[name] += delta
