"""The write half of a node's store: a planned segment's bytes onto its medium, then publish.

The store plans a put (``Catalog.plan_put``: placement, allocation, the scope pinned) and hands
the plan to a :class:`PutHandle` (``put.py``), which calls this writer:

- ``write_pages(state, layer, first, pages)``: pages of keys ``[first, first + n)`` of one
  layer, in key order; the writer keeps those the plan writes (keys not stored yet). A DRAM
  page goes straight into the arena; an SSD layer is assembled in an aligned staging buffer
  and written with one O_DIRECT command once all its pages are in, behind the caller (at
  most ``WRITES_BEHIND`` layers of a put at once: its next layer is copied while the drive
  writes; a failed write is raised by the next call). A finished layer gets its per-block
  checksums.
- ``land_layer(state, layer, source)``: a whole layer of the segment's new pages written by
  someone else: in place in the arena (``source`` None: a client wrote its DRAM extent) or in
  ``source`` (a landing slot of this node's, or the bytes of a call), copied to the arena or
  written to the drive with one O_DIRECT command straight from ``source``.
- ``commit(state)``: every layer written, data on the drive (fdatasync when ``fsync``), the
  manifest record written, then the keys published: a reader never sees a key whose bytes
  or record are not there.
- ``abort(state)``: the space goes back; nothing was published.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flatcake_ray.config import ALIGN
from flatcake_ray.core.catalog import Catalog, PutPlan
from flatcake_ray.core.gva import Medium
from flatcake_ray.cuda_ext.host_copy import copy_into
from flatcake_ray.cuda_ext.host_hash import copy_hashing_source
from flatcake_ray.errors import TamperedWriteError
from flatcake_ray.failpoints import failpoint
from flatcake_ray.media.arena import DramArena
from flatcake_ray.media.buffers import AlignedBuffer, StagingBuffers
from flatcake_ray.media.pool import SsdPool
from flatcake_ray.node.checksums import parallel_layer_checksums
from flatcake_ray.node.manifest import Manifest
from flatcake_ray.node.sealed_write import seal_and_write

log = logging.getLogger(__name__)
# Layers of one put a store writes to its drive behind its caller (``write_pages``): the next
# layer is copied into staging while the drive takes the last; more wait (bounded memory).
WRITES_BEHIND = 2


@dataclass
class WriteState:
    """One planned segment being written."""

    plan: PutPlan
    catalog: Catalog  # the tenant's catalog the plan was made in
    keys: int  # keys of the put (pages written are the plan's new positions among them)
    received: np.ndarray  # per layer: new pages written so far
    checksums: np.ndarray  # uint64 [layers, blocks], the segment's, filled as layers finish
    staging: dict[int, AlignedBuffer] = field(default_factory=dict)  # SSD layers in progress
    # Per layer written whole in one call: its block checksums, taken during the copy.
    sums_taken: dict[int, np.ndarray] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    writes: deque[Future[None]] = field(default_factory=deque)  # staged layers on their way

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
        check_landed: bool = True,
    ) -> None:
        self._lock = lock  # the store's: the catalog and counters change under it
        # Hash what another writer landed and hold it against its sums. Needless where every
        # reader checks every block (``verify_dram``): the writer's sums are kept, so bytes
        # that are not what it wrote are a miss for every reader, never data.
        self.check_landed = check_landed
        self.arena = arena
        self.pool = pool
        self.manifest = manifest
        self.counters = counters
        self.fsync = fsync
        self._check_open = check_open
        self._staging = StagingBuffers()
        self._drive = ThreadPoolExecutor(WRITES_BEHIND, thread_name_prefix="flatcake-ssd-write")

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
        picked = positions[lo:hi] - first
        if picked[-1] - picked[0] == hi - lo - 1:  # consecutive keys: a view, no copy
            chosen = pages[picked[0] : picked[-1] + 1]
        else:
            chosen = pages[picked]
        failpoint("store.write_layer", layer=layer, medium=state.plan.segment.medium)
        with state.lock:
            self._place(state, layer, int(lo), chosen)
            state.received[layer] += hi - lo
            done = state.received[layer] == state.pages_new
        if done:
            self._finish_layer(state, layer)

    def layer_extent(self, state: WriteState, layer: int) -> int:
        """Where layer ``layer``'s new pages start on the segment's medium (a GVA offset)."""
        segment = state.plan.segment
        return segment.offset + segment.layout.layer_offset(layer)

    def land_layer(
        self,
        state: WriteState,
        layer: int,
        source: np.ndarray | None,
        sums: np.ndarray | None = None,
    ) -> None:
        """Layer ``layer`` complete (see the module docstring); ``source``: at least
        ``layer_bytes`` (SSD: ``layer_stride``, aligned) bytes, or None for in-place DRAM.
        ``sums``: the block checksums its writer computed from its own copy (a client that
        wrote the owner's shared memory): bytes found otherwise are refused
        (:class:`TamperedWriteError`), and the writer's checksums are the ones kept, so a
        later write there is a checksum failure for every reader, never its bytes."""
        segment = state.plan.segment
        layout = segment.layout
        failpoint("store.write_layer", layer=layer, medium=segment.medium)
        with state.lock:
            state.received[layer] = state.pages_new
        self._count(layers_landed=1)
        if segment.medium is Medium.DRAM:
            if source is not None:
                self.arena.write(self.layer_extent(state, layer), source[: layout.layer_bytes])
            self._finish_dram_layer(state, layer, sums)
            return
        assert source is not None
        # The drive is written straight from ``source`` where it can be: its tail past the
        # pages is zeroed and a sealed layer is sealed in it. A call's bytes may be read-only
        # (Ray hands out its object store's memory so), and aligned by chance.
        in_place = (
            source.flags.writeable
            and source.nbytes >= layout.layer_stride
            and source.ctypes.data % ALIGN == 0
        )
        staging = None if in_place else self._staging.take(layout.layer_stride)
        block = source[: layout.layer_stride] if staging is None else staging.array
        try:
            if staging is not None:  # bytes of a call: O_DIRECT needs an aligned buffer
                copy_into(block[: layout.layer_bytes], source[: layout.layer_bytes])
            self._write_ssd_layer(state, layer, block[: layout.layer_stride], sums)
        finally:
            if staging is not None:
                self._staging.give(staging)

    def _place(self, state: WriteState, layer: int, first_new: int, pages: np.ndarray) -> None:
        """Put new pages ``[first_new, first_new + n)`` of ``layer`` where they belong."""
        segment = state.plan.segment
        layout = segment.layout
        at = first_new * layout.page_bytes
        if segment.medium is Medium.DRAM:
            into = self.arena.view[self.layer_extent(state, layer) + at :][: pages.nbytes]
        else:
            if layer not in state.staging:
                state.staging[layer] = self._staging.take(layout.layer_stride)
            into = state.staging[layer].array[at : at + pages.nbytes]
        flat = np.ascontiguousarray(pages).reshape(-1).view(np.uint8)
        if first_new == 0 and flat.nbytes == layout.layer_bytes:  # the whole layer: one pass
            sums = copy_hashing_source(into, flat, layout.check_pages * layout.page_bytes)
            if sums is not None:
                state.sums_taken[layer] = sums
                return
        copy_into(into, flat)

    def _finish_layer(self, state: WriteState, layer: int) -> None:
        if state.plan.segment.medium is Medium.DRAM:
            self._finish_dram_layer(state, layer)
            return
        staging = state.staging.pop(layer)
        state.writes.append(self._drive.submit(self._write_staged, state, layer, staging))
        self._settle(state, WRITES_BEHIND)

    def _write_staged(self, state: WriteState, layer: int, staging: AlignedBuffer) -> None:
        try:
            stride = state.plan.segment.layout.layer_stride
            self._write_ssd_layer(state, layer, staging.array[:stride])
        finally:
            self._staging.give(staging)

    @staticmethod
    def _settle(state: WriteState, keep: int) -> None:
        """Wait until at most ``keep`` staged layers are still being written; a failed write
        raises its error here (the caller aborts the put)."""
        while len(state.writes) > keep:
            state.writes.popleft().result()

    def _finish_dram_layer(
        self, state: WriteState, layer: int, sums: np.ndarray | None = None
    ) -> None:
        """The layer's new pages are in the arena: their checksums."""
        layout = state.plan.segment.layout
        start = self.layer_extent(state, layer)
        extent = self.arena.view[start : start + layout.layer_bytes]
        state.checksums[layer] = self._layer_sums(state, layer, extent, sums)
        self._count(dram_bytes_written=layout.layer_bytes)

    def _layer_sums(
        self, state: WriteState, layer: int, written: np.ndarray, sums: np.ndarray | None
    ) -> np.ndarray:
        """The checksums kept for a finished layer: those this node took while copying its
        own caller's bytes (what it meant to write: a later change there fails every reader's
        check); else its writer's ``sums`` as sent, where readers check every block; else
        those of ``written``, held against the writer's ``sums``."""
        taken = state.sums_taken.pop(layer, None)
        if taken is not None:
            return taken
        layout = state.plan.segment.layout
        if sums is not None and not self.check_landed:
            if sums.shape != (layout.blocks,):
                raise TamperedWriteError(
                    f"layer {layer}: {sums.shape} checksums sent for {layout.blocks} blocks"
                )
            return sums
        return _as_written(parallel_layer_checksums(written, layout), sums, layer)

    def _write_ssd_layer(
        self, state: WriteState, layer: int, block: np.ndarray, sums: np.ndarray | None = None
    ) -> None:
        """``block`` (``layer_stride`` aligned bytes, the new pages first) to the drive with one
        O_DIRECT command, and to the segment's DRAM read replica if it has one."""
        layout = state.plan.segment.layout
        replica = state.plan.replica  # a DRAM read replica of the same bytes (placement.py)
        block[layout.layer_bytes : layout.layer_stride] = 0
        state.checksums[layer] = self._layer_sums(state, layer, block, sums)
        if replica is not None:  # plain bytes: the replica is the tenant's own chunk
            at = replica.offset + layout.layer_offset(layer)
            self.arena.write(at, block[: layout.layer_bytes])
            self._count(dram_bytes_written=layout.layer_bytes)
        at, stride = self.layer_extent(state, layer), block[: layout.layer_stride]
        if state.plan.segment.sealed:
            key = state.catalog.seal_key
            assert key is not None  # planned sealed only where its tenant's key is known
            commands = seal_and_write(self.pool, at, stride, key, layout, state.checksums[layer])
        else:
            self.pool.write(at, stride)
            commands = 1
        self._count(ssd_bytes_written=layout.layer_stride, ssd_write_commands=commands)

    def commit(self, state: WriteState) -> np.ndarray:
        """Make the segment durable and its keys visible; returns the mask published."""
        plan = state.plan
        segment = plan.segment
        self._settle(state, 0)  # every layer on the drive, its checksums taken
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
            "sealed": segment.sealed,
        }

    def abort(self, state: WriteState) -> None:
        for write in state.writes:  # its space goes back only once nothing writes there
            error = write.exception()
            if error is not None:
                log.info("a layer write of an aborted put failed: %s", error)
        state.writes.clear()
        with state.lock:
            for staging in state.staging.values():
                self._staging.give(staging)
            state.staging.clear()
        with self._lock:
            state.catalog.abort(state.plan)
            self.counters["write_failures"] += 1

    def close(self) -> None:
        """After every put ended (the store aborts the open ones first)."""
        self._drive.shutdown(wait=True)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self.counters[name] += delta


def _as_written(found: np.ndarray, sums: np.ndarray | None, layer: int) -> np.ndarray:
    """The checksums to keep for a layer: its writer's (``sums``), if they match ``found``
    (computed from the memory it wrote); a mismatch is :class:`TamperedWriteError`."""
    if sums is None:
        return found
    if sums.shape != found.shape or not np.array_equal(sums, found):
        raise TamperedWriteError(
            f"layer {layer} in this node's memory is not what its writer wrote: another "
            "writer changed it; the put is aborted"
        )
    return sums
