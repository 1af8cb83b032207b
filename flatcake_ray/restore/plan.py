"""How one layer of a leased prefix streams through a bounded staging slot (FC-CIO, 3.4).

Pure planning plus the SSD reads; no threads, no scatter. The restore pipeline
(``restore.py``) calls :meth:`LayerStager.chunks` for each layer in order, fills each chunk's
slot with :meth:`LayerStager.fill` (a worker thread, O_DIRECT, GIL released), then feeds the
chunk's :class:`HashSpan` s to their :class:`ExtentCheck` and scatters its :class:`PageRun` s.

A chunk never needs more than ``capacity`` bytes of staging, whatever the context length:

- SSD: a segment's layer extent is the unit a checksum covers, so it is read whole. Extents
  are sort-merge coalesced (gaps under ``gap_bytes`` bridged) into reads of at most
  ``capacity`` bytes; small reads are packed into one chunk, and a read longer than a slot is
  cut into slot-sized pieces. A page is delivered from the one piece that holds it whole, so a
  piece ends on a 4 KiB boundary and the next starts at the 4 KiB boundary below the page cut
  in two (it re-reads under 4 KiB). The extent's checksum is fed span by span, in order, and
  is decided by the chunk that holds its last byte: pages of a long extent are scattered
  before it is verified, and a failure withdraws them (the verified prefix shrinks).
- DRAM: pages are copied from the shared arena; on a CPU destination they need no staging at
  all, on a GPU one a chunk's pages are copied to the device slot first.

Needs ``capacity >= page_bytes + 4096`` so any page fits one piece.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import xxhash

from flatcake_ray.config import ALIGN
from flatcake_ray.core.catalog import Lease
from flatcake_ray.core.coalesce import coalesce
from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import ConfigError
from flatcake_ray.node.reader import SegmentReader, ssd_extents


class ExtentCheck:
    """The streaming checksum of one segment's layer extent, fed in order across chunks."""

    def __init__(self, expected: int, scope_id: int, first_position: int) -> None:
        self.expected = expected
        self.scope_id = scope_id
        # A failure quarantines the whole scope, so the verified prefix ends at its first page.
        self.first_position = first_position
        self._hash = xxhash.xxh3_64()

    def update(self, data: np.ndarray) -> None:
        self._hash.update(memoryview(data))

    def matches(self) -> bool:
        return self._hash.intdigest() == self.expected


@dataclass(frozen=True)
class HashSpan:
    check: ExtentCheck
    offset: int  # bytes into the chunk's source (its slot for SSD, the arena for DRAM)
    length: int
    last: bool  # the extent's final bytes: decide the check after feeding these


@dataclass(frozen=True)
class PageRun:
    """Pages back to back in a chunk's source, bound for request ``positions`` in order."""

    offset: int  # bytes into the chunk's source
    positions: np.ndarray
    scope_id: int


@dataclass(frozen=True)
class SlotRead:
    file: int
    file_offset: int
    length: int
    offset: int  # bytes into the slot


@dataclass
class LayerChunk:
    layer: int
    medium: Medium  # SSD: source is the slot, filled by ``reads``; DRAM: source is the arena
    nbytes: int = 0  # slot bytes used
    reads: list[SlotRead] = field(default_factory=list)
    hashes: list[HashSpan] = field(default_factory=list)
    runs: list[PageRun] = field(default_factory=list)
    last: bool = False  # the layer is in place once this chunk is scattered


def _runs(pages: np.ndarray, max_pages: int) -> list[tuple[int, int]]:
    """[start, stop) index ranges of ``pages`` that are consecutive, at most ``max_pages`` long."""
    cuts = np.flatnonzero(np.diff(pages) != 1) + 1
    bounds = [0, *cuts.tolist(), len(pages)]
    spans: list[tuple[int, int]] = []
    for start, stop in itertools.pairwise(bounds):
        spans.extend((s, min(s + max_pages, stop)) for s in range(start, stop, max_pages))
    return spans


@dataclass
class _Extent:
    """One SSD segment's layer extent inside a coalesced read, and how far it has streamed."""

    skip: int  # byte offset inside the read
    length: int
    page_bytes: int
    src: np.ndarray  # wanted pages of the segment, ascending
    positions: np.ndarray  # their request positions
    scope_id: int
    check: ExtentCheck
    delivered: int = 0  # wanted pages handed out so far
    hashed: int = 0  # extent bytes fed to the checksum so far


class LayerStager:
    """Plans a lease's layers as bounded chunks and fills their slots; one per restore."""

    def __init__(self, reader: SegmentReader, lease: Lease, capacity: int) -> None:
        self.check_capacity(capacity, reader.config.page_bytes)
        self.reader = reader
        self.capacity = capacity
        self.parts = reader.parts(lease)
        self.ssd_parts = [p for p in self.parts if p.segment.medium is Medium.SSD]
        self.dram_parts = [p for p in self.parts if p.segment.medium is Medium.DRAM]
        self.scope_first: dict[int, int] = {}  # scope -> its first request position
        for part in self.parts:
            first = int(part.dst_positions.min())
            scope_id = part.segment.scope_id
            self.scope_first[scope_id] = min(first, self.scope_first.get(scope_id, first))

    def _check(self, segment, layer: int) -> ExtentCheck:
        first = self.scope_first[segment.scope_id]
        return ExtentCheck(int(segment.checksums[layer]), segment.scope_id, first)

    @staticmethod
    def check_capacity(capacity: int, page_bytes: int) -> None:
        if not isinstance(capacity, int) or capacity % ALIGN or capacity < page_bytes + ALIGN:
            raise ConfigError(
                f"a staging slot of {capacity!r} bytes must be a multiple of {ALIGN} and hold a "
                f"page plus {ALIGN} bytes ({page_bytes + ALIGN})"
            )

    @property
    def ssd_pages(self) -> int:
        return sum(len(p.src_pages) for p in self.ssd_parts)

    def chunks(self, layer: int) -> list[LayerChunk]:
        chunks = self._dram_chunks(layer) + self._ssd_chunks(layer)
        if chunks:
            chunks[-1].last = True
        return chunks

    def fill(self, chunk: LayerChunk, slot: np.ndarray) -> None:
        """Read an SSD chunk's extents into ``slot`` (aligned host bytes); blocks on the drive."""
        for read in chunk.reads:
            view = slot[read.offset : read.offset + read.length]
            self.reader.pool.read_into(read.file, read.file_offset, view)

    # ---- DRAM ----------------------------------------------------------------------------
    def _dram_chunks(self, layer: int) -> list[LayerChunk]:
        page_bytes = self.reader.config.page_bytes
        chunks: list[LayerChunk] = []
        for part in self.dram_parts:
            segment, layout = part.segment, part.segment.layout
            base = segment.offset + layout.layer_offset(layer)
            order = np.argsort(part.src_pages, kind="stable")
            src, positions = part.src_pages[order], part.dst_positions[order]
            pending_hash = []
            if self.reader.config.verify_dram:
                check = self._check(segment, layer)
                pending_hash.append(HashSpan(check, base, layout.layer_bytes, True))
            for start, stop in _runs(src, max(1, self.capacity // page_bytes)):
                nbytes = (stop - start) * page_bytes
                if not chunks or chunks[-1].nbytes + nbytes > self.capacity:
                    chunks.append(LayerChunk(layer, Medium.DRAM))
                chunk = chunks[-1]
                chunk.hashes.extend(pending_hash)
                pending_hash = []
                offset = base + int(src[start]) * page_bytes
                chunk.runs.append(PageRun(offset, positions[start:stop], segment.scope_id))
                chunk.nbytes += nbytes
        return chunks

    # ---- SSD -----------------------------------------------------------------------------
    def _ssd_chunks(self, layer: int) -> list[LayerChunk]:
        if not self.ssd_parts:
            return []
        located = ssd_extents(self.ssd_parts, [layer], self.reader.pool.file_bytes)
        reads = coalesce(
            located.files,
            located.offsets,
            located.lengths,
            gap_bytes=self.reader.config.gap_bytes,
            max_read_bytes=self.capacity,
            align=ALIGN,
        )
        members: list[list[_Extent]] = [[] for _ in range(reads.count)]
        for d, part in enumerate(self.ssd_parts):
            members[int(reads.descriptor_read[d])].append(
                self._extent(part, layer, int(reads.descriptor_skip[d]))
            )
        chunks = [LayerChunk(layer, Medium.SSD)]
        for r in range(reads.count):
            extents = sorted(members[r], key=lambda e: e.skip)
            self._stream_read(
                chunks, int(reads.files[r]), int(reads.offsets[r]), int(reads.lengths[r]), extents
            )
        return [c for c in chunks if c.reads]

    def _extent(self, part, layer: int, skip: int) -> _Extent:
        segment = part.segment
        order = np.argsort(part.src_pages, kind="stable")
        positions = part.dst_positions[order]
        check = self._check(segment, layer)
        return _Extent(
            skip,
            segment.layout.layer_bytes,
            segment.layout.page_bytes,
            part.src_pages[order],
            positions,
            segment.scope_id,
            check,
        )

    def _stream_read(
        self,
        chunks: list[LayerChunk],
        file: int,
        file_offset: int,
        length: int,
        extents: list[_Extent],
    ) -> None:
        """Cut one coalesced read into pieces that fit the slots, appending to ``chunks``."""
        start = 0
        while start < length:
            room = self.capacity - chunks[-1].nbytes
            if room < min(length - start, self.capacity):
                chunks.append(LayerChunk(chunks[-1].layer, Medium.SSD))
                room = self.capacity
            end = min(length, start + room)
            chunk = chunks[-1]
            base = chunk.nbytes - start  # slot offset of read byte 0 for this piece
            chunk.reads.append(SlotRead(file, file_offset + start, end - start, chunk.nbytes))
            chunk.nbytes += end - start
            cut = None
            for extent in extents:
                cut = self._piece(chunk, extent, end, base, cut)
            start = cut // ALIGN * ALIGN if cut is not None else end

    @staticmethod
    def _piece(
        chunk: LayerChunk, extent: _Extent, end: int, base: int, cut: int | None
    ) -> int | None:
        """Hash and deliver what of ``extent`` lies before read byte ``end``; returns the
        start of the first page cut in two by ``end`` (the next piece starts at it)."""
        hash_from, hash_to = extent.skip + extent.hashed, min(end, extent.skip + extent.length)
        if hash_to > hash_from:
            last = hash_to == extent.skip + extent.length
            chunk.hashes.append(HashSpan(extent.check, base + hash_from, hash_to - hash_from, last))
            extent.hashed = hash_to - extent.skip
        whole = max(0, (end - extent.skip) // extent.page_bytes)  # pages ending by ``end``
        stop = int(np.searchsorted(extent.src, whole, side="left"))
        first = extent.delivered
        for run_start, run_stop in _runs(extent.src[first:stop], len(extent.src)):
            page = int(extent.src[first + run_start])
            chunk.runs.append(
                PageRun(
                    base + extent.skip + page * extent.page_bytes,
                    extent.positions[first + run_start : first + run_stop],
                    extent.scope_id,
                )
            )
        extent.delivered = max(first, stop)
        if cut is None and extent.delivered < len(extent.src):
            page_start = extent.skip + int(extent.src[extent.delivered]) * extent.page_bytes
            if page_start < end:
                return page_start
        return cut
