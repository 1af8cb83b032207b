"""The read path of a node's store: a lease's pages, per layer, from DRAM and SSD into
caller buffers, with SSD reads sort-merge coalesced and every SSD extent's checksum checked.

A read is done at the granularity of a segment's layer extent (its pages of one layer, one
contiguous range): that is the unit a checksum covers, and for a prefix restore it is almost
always fully wanted anyway (only a partial last turn reads pages it drops; counted as read
amplification). The restore pipeline calls :meth:`SegmentReader.read` one layer at a time.
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np
import xxhash

from flatcake_ray.config import ALIGN, StoreConfig
from flatcake_ray.core.catalog import Lease, Segment
from flatcake_ray.core.coalesce import coalesce
from flatcake_ray.core.gva import Medium
from flatcake_ray.media.arena import DramArena
from flatcake_ray.media.buffers import AlignedBuffer
from flatcake_ray.media.pool import SsdPool


def checksum(data: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(data))


@dataclass
class ReadOutcome:
    pages_ok: int  # consecutive pages from the first that are in ``out`` and verified
    bad_scopes: set[int] = field(default_factory=set)
    ssd_commands: int = 0
    ssd_bytes: int = 0
    dram_bytes: int = 0


@dataclass(frozen=True)
class _Part:
    """The pages a lease wants from one segment: where they sit and where they go."""

    segment: Segment
    src_pages: np.ndarray
    dst_positions: np.ndarray

    def copy_layer(self, layer: int, extent: np.ndarray, out: np.ndarray) -> None:
        pages = extent.reshape(self.segment.layout.pages, self.segment.layout.page_bytes)
        src, dst = self.src_pages, self.dst_positions
        if _is_run(src) and _is_run(dst):  # the usual prefix: one memcpy, no temporary
            out[layer, dst[0] : dst[0] + len(dst)] = pages[src[0] : src[0] + len(src)]
        else:
            out[layer, dst] = pages[src]


def _is_run(values: np.ndarray) -> bool:
    return (
        len(values) > 0
        and int(values[-1]) - int(values[0]) == len(values) - 1
        and (len(values) < 3 or bool((np.diff(values) == 1).all()))
    )


@dataclass(frozen=True)
class SsdExtents:
    """The SSD layer extents of some lease parts, one row per (part, layer), part-major."""

    files: np.ndarray  # pool file of each extent
    offsets: np.ndarray  # byte offset inside that file
    lengths: np.ndarray  # the segment's layer_bytes
    part_of_row: np.ndarray  # index into the parts given
    layer_of_row: np.ndarray


def lease_parts(lease: Lease) -> list[_Part]:
    """A lease's pages grouped by segment (no I/O)."""
    order = np.argsort(lease.segment_ids, kind="stable")
    ids = lease.segment_ids[order]
    cuts = np.flatnonzero(np.diff(ids)) + 1
    return [
        _Part(lease.segments[int(ids[group[0]])], lease.pages[order[group]], order[group])
        for group in np.split(np.arange(len(ids)), cuts)
        if group.size
    ]


def ssd_extents(parts: Sequence[_Part], layers: Sequence[int], file_bytes: int) -> SsdExtents:
    """Where the ``layers`` extents of SSD ``parts`` lie in the pool, without I/O.

    Shared by the live reader and the replay model, so both coalesce the same descriptors.
    """
    layer_ids = np.asarray(list(layers), dtype=np.int64)
    starts = np.array([p.segment.offset for p in parts], dtype=np.int64)
    strides = np.array([p.segment.layout.layer_stride for p in parts], dtype=np.int64)
    extent = np.array([p.segment.layout.layer_bytes for p in parts], dtype=np.int64)
    part_of_row = np.repeat(np.arange(len(parts)), len(layer_ids))
    layer_of_row = np.tile(layer_ids, len(parts))
    pool_offsets = starts[part_of_row] + layer_of_row * strides[part_of_row]
    files, offsets = np.divmod(pool_offsets, file_bytes)
    return SsdExtents(files, offsets, extent[part_of_row], part_of_row, layer_of_row)


class BufferPool:
    """Pairs of aligned read buffers shared by concurrent readers: bounded memory.

    A reader takes a whole pair at once (one buffer filled by the drive while the other is
    checked and copied out), so readers can never deadlock holding half a pair each. Reusing
    buffers matters too: a fresh one costs a page fault per 4 KiB on its first read.
    """

    def __init__(self, pairs: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: queue.SimpleQueue[tuple[AlignedBuffer, AlignedBuffer]] = queue.SimpleQueue()
        for _ in range(pairs):
            self._free.put((AlignedBuffer(nbytes), AlignedBuffer(nbytes)))

    def acquire_pair(self) -> tuple[AlignedBuffer, AlignedBuffer]:
        return self._free.get()

    def release_pair(self, pair: tuple[AlignedBuffer, AlignedBuffer]) -> None:
        self._free.put(pair)


class SegmentReader:
    def __init__(self, config: StoreConfig, arena: DramArena, pool: SsdPool) -> None:
        self.config = config
        self.arena = arena
        self.pool = pool
        # Two buffers per concurrent reader: one being filled by the drive while the other is
        # checked and copied out, so a get runs at max(drive, memcpy), not their sum.
        self.buffers = BufferPool(2, config.max_read_bytes)
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="flatcake-read")

    def close(self) -> None:
        self._io.shutdown(wait=True)

    def parts(self, lease: Lease) -> list[_Part]:
        return lease_parts(lease)

    def read(self, lease: Lease, out: np.ndarray, layers: Iterable[int]) -> ReadOutcome:
        """Fill ``out[l, position]`` (uint8 [layers, pages, page_bytes]) for ``layers``."""
        layers = list(layers)
        outcome = ReadOutcome(lease.hits)
        parts = self.parts(lease)
        for part in parts:
            if part.segment.medium is Medium.DRAM:
                self._read_dram(part, out, layers, outcome)
        ssd_parts = [p for p in parts if p.segment.medium is Medium.SSD]
        if ssd_parts:
            self._read_ssd(ssd_parts, out, layers, outcome)
        for part in parts:
            if part.segment.scope_id in outcome.bad_scopes:
                outcome.pages_ok = min(outcome.pages_ok, int(part.dst_positions.min()))
        return outcome

    def _read_dram(
        self, part: _Part, out: np.ndarray, layers: list[int], outcome: ReadOutcome
    ) -> None:
        segment = part.segment
        layout = segment.layout
        for layer in layers:
            start = segment.offset + layout.layer_offset(layer)
            extent = self.arena.view[start : start + layout.layer_bytes]
            if self.config.verify_dram and checksum(extent) != int(segment.checksums[layer]):
                outcome.bad_scopes.add(segment.scope_id)
                return
            part.copy_layer(layer, extent, out)
            outcome.dram_bytes += len(part.src_pages) * layout.page_bytes

    def _read_ssd(
        self, parts: list[_Part], out: np.ndarray, layers: list[int], outcome: ReadOutcome
    ) -> None:
        extents = ssd_extents(parts, layers, self.pool.file_bytes)
        lengths = extents.lengths
        reads = coalesce(
            extents.files,
            extents.offsets,
            lengths,
            gap_bytes=self.config.gap_bytes,
            max_read_bytes=self.config.max_read_bytes,
            align=ALIGN,
        )
        by_read = np.argsort(reads.descriptor_read, kind="stable")
        bounds = np.searchsorted(reads.descriptor_read[by_read], np.arange(reads.count + 1))
        pair = self.buffers.acquire_pair()
        pending = self._submit(reads, 0, pair)
        try:
            for r in range(reads.count):
                view = pending.result()
                pending = self._submit(reads, r + 1, pair)
                for d in by_read[bounds[r] : bounds[r + 1]]:
                    part, layer = parts[extents.part_of_row[d]], int(extents.layer_of_row[d])
                    skip = int(reads.descriptor_skip[d])
                    self._deliver(part, layer, view[skip : skip + int(lengths[d])], out, outcome)
        finally:
            wait([pending])  # never hand the pair back while the drive still fills it
            self.buffers.release_pair(pair)
        outcome.ssd_commands += reads.count
        outcome.ssd_bytes += reads.bytes

    def _submit(self, reads, r: int, pair: tuple[AlignedBuffer, AlignedBuffer]) -> Future:
        """Start read ``r`` into the half of ``pair`` that read ``r - 1`` is not using."""
        if r >= reads.count:
            done: Future = Future()
            done.set_result(None)
            return done
        length = int(reads.lengths[r])
        # A single descriptor longer than max_read_bytes gets a one-off buffer.
        buffer = pair[r % 2] if length <= self.buffers.nbytes else AlignedBuffer(length)
        view = buffer.array[:length]
        file_index, file_offset = int(reads.files[r]), int(reads.offsets[r])

        def fill() -> np.ndarray:
            self.pool.read_into(file_index, file_offset, view)
            return view

        return self._io.submit(fill)

    def _deliver(
        self, part: _Part, layer: int, extent: np.ndarray, out: np.ndarray, outcome: ReadOutcome
    ) -> None:
        segment = part.segment
        if segment.scope_id in outcome.bad_scopes:
            return
        if checksum(extent) != int(segment.checksums[layer]):
            outcome.bad_scopes.add(segment.scope_id)
            return
        part.copy_layer(layer, extent, out)
