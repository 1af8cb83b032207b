"""How one layer of a leased prefix streams through a bounded staging slot (FC-CIO, 3.4).

Pure planning, shared by the live restore pipeline (both stores) and the replay model: no
threads, no I/O. A restore moves its layers in order, in *groups*: consecutive layers whose
filled bytes fit ``FILL_GROUP_BYTES`` together (one layer per group once a layer is that big,
so a long context streams layer by layer; a short one is read in a few commands). For each group
:meth:`RestorePlan.chunks` returns the chunks to move, in order; each fits one slot of
``capacity`` bytes whatever the context length. A chunk (``core/chunks.py``) says which
bytes to read into its slot (``SlotRead``), which blocks and byte spans feed which checksum
(``BlockRows``, ``HashSpan``) and which pages of which layer go to which request positions
(``PageRun``).

How a source reaches a medium is its :class:`MediumAccess`:

- *mapped* (the local DRAM arena): the pages are read in place from a host view of the
  medium; no slot, no read. A chunk only groups page runs (a GPU destination packs them into
  a device slot).
- *filled* (SSD; remote DRAM): wanted byte ranges are sort-merge coalesced (holes under
  ``gap_bytes`` bridged, ends aligned for O_DIRECT, never across a pool file) into reads of at
  most ``capacity`` bytes; small reads share a chunk, a read longer than a slot is cut into
  pieces. With ``verify`` a range covers the whole checksum blocks holding its pages, so
  every delivered byte is checked and a partial segment costs at most one block per end.

A page is delivered from the one piece that holds it whole: a piece ends on the alignment
and the next starts at the alignment below the page cut in two. A block's checksum is fed
span by span, in order, and decided by the span holding its last byte, so pages of a long
block may be scattered before it is verified; a failure withdraws them (the verified prefix
shrinks to the scope's first position).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from flatcake_ray.core.block_checks import BlockRows
from flatcake_ray.core.chunks import (
    LayerChunk,
    MappedShape,
    PageRun,
    SlotRead,
    WantedRange,
    cut_piece,
)
from flatcake_ray.core.coalesce import CoalescedReads, coalesce
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.parts import (
    LeasePart,
    block_ranges,
    filled_bytes,
    first_positions,
    page_ranges,
)
from flatcake_ray.core.runs import align_down
from flatcake_ray.errors import ConfigError
from flatcake_ray.failpoints import failpoint


@dataclass(frozen=True)
class MediumAccess:
    """How a source reaches one medium of a lease (declared by the source)."""

    mapped: bool  # a host view addresses the medium: pages are read in place
    verify: bool  # check every block read (always for SSD)
    file_bytes: int  # a read never crosses a multiple of this (one pool file)
    align: int = 1  # reads start and end on multiples of this (O_DIRECT: 4096)
    gap_bytes: int = 0  # holes smaller than this between wanted ranges are read and dropped


def check_capacity(capacity: int, page_bytes: int, align: int) -> None:
    if not isinstance(capacity, int) or capacity % align or capacity < page_bytes + align:
        raise ConfigError(
            f"a staging slot of {capacity!r} bytes must be a multiple of {align} and hold a "
            f"page plus {align} bytes ({page_bytes + align})"
        )


# The filled bytes (SSD, remote DRAM) of one group of layers. An engine waits for its KV layer
# by layer (vLLM's ``wait_for_layer_load``): a group is delivered once it is read, so its
# first layer's wait is the whole group's read. In groups of a slot (16 MiB) a vLLM SSD hit of
# 8 layers x 2 MB was one read, waited for whole before layer 0 ran (wait 10.8 ms of a 34 ms
# TTFT); in groups of 2 MiB the drive reads layer l + 1 while layer l runs (wait 2.4 ms, TTFT
# 24.5 ms). A layer of 2 MiB or more is a group of its own either way.
FILL_GROUP_BYTES = 2 << 20


class RestorePlan:
    """The chunks of one restore, group by group; built once per restore."""

    def __init__(
        self,
        parts: Sequence[LeasePart],
        capacity: int,
        access: Mapping[Medium, MediumAccess],
        *,
        in_place_bytes: int | None = None,
    ) -> None:
        """``capacity``: a slot's bytes. ``in_place_bytes``: a mapped chunk's bytes where its
        pages are copied in place with no slot (a host destination): one chunk is one batch
        of copies, and fewer, larger batches cost less between them; a slot's by default."""
        self.parts = tuple(parts)
        self.capacity = capacity
        # A host destination: mapped pages are copied in place, several layers in one batch.
        self.to_host = in_place_bytes is not None
        self.in_place_bytes = capacity if in_place_bytes is None else in_place_bytes
        self.access = dict(access)
        for part in self.parts:
            check_capacity(capacity, part.layout.page_bytes, self.access[part.medium].align)
        self.scope_first = first_positions(self.parts)
        self.layers = self.parts[0].layout.layers if self.parts else 0
        self.groups = self._groups()
        # Each part's wanted page spans, the same for every layer group: found once.
        self._span_cache: dict[tuple[int, bool], list[tuple[int, int]]] = {}
        self._grids: dict[tuple[Medium, bool, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._shapes: dict[tuple[int, bool], MappedShape] = {}

    @property
    def fills(self) -> bool:
        """Some pages are read into slots (a medium that is not mapped)."""
        return any(not self.access[part.medium].mapped for part in self.parts)

    def _groups(self) -> list[tuple[int, int]]:
        """[first, end) layers moved together: as many as fit one slot and
        ``FILL_GROUP_BYTES`` (at least one); a restore of mapped pages into host memory only,
        as many as one batch of copies holds (a small restore is one batch: its per-layer
        costs were most of its time)."""
        per_layer = sum(
            filled_bytes(part, self.access[part.medium].verify)
            for part in self.parts
            if not self.access[part.medium].mapped
        )
        mapped = sum(len(part.src_pages) * part.layout.page_bytes for part in self.parts)
        if per_layer:
            size = max(1, min(self.capacity, FILL_GROUP_BYTES) // per_layer)
        elif self.to_host and mapped:
            size = max(1, self.in_place_bytes // mapped)
        else:
            size = 1
        return [(first, min(first + size, self.layers)) for first in range(0, self.layers, size)]

    def chunks(self, first: int, end: int) -> list[LayerChunk]:
        """The chunks that move layers ``[first, end)`` (a group), in order."""
        failpoint("plan.chunks", first=first, end=end)
        chunks: list[LayerChunk] = []
        for medium in (Medium.DRAM, Medium.SSD):
            parts = [p for p in self.parts if p.medium is medium]
            if not parts:
                continue
            access = self.access[medium]
            if access.mapped:
                for layer in range(first, end):
                    for chunk in self._mapped_chunks(parts, layer, medium, access):
                        self._add_mapped(chunks, chunk)
            else:
                chunks.extend(self._filled_chunks(parts, first, end, medium, access))
        if chunks:
            chunks[-1].done_layer = end - 1
        return chunks

    def reads(self, first: int, end: int, medium: Medium) -> CoalescedReads:
        """The coalesced reads of layers ``[first, end)`` on a filled ``medium``: those
        ``chunks`` issues, found without building its per-range delivery state."""
        access = self.access[medium]
        base, stride, length = self._read_grid(medium, access.verify, end - first)
        return self._coalesce_bytes(base + first * stride, length, access)

    def _read_grid(
        self, medium: Medium, verify: bool, layers: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per wanted range of a group of ``layers`` layers starting at layer 0, in the order
        ``_ranges`` lists them (part, layer, span): its byte offset on the medium, its part's
        layer stride (a group starting at layer f adds f strides) and its length."""
        key = (medium, verify, layers)
        grid = self._grids.get(key)
        if grid is None:
            columns: tuple[list[np.ndarray], ...] = ([], [], [])
            for part in self.parts:
                if part.medium is not medium:
                    continue
                spans = np.array(self._spans(part, verify), dtype=np.int64).reshape(-1, 2)
                page, stride = part.layout.page_bytes, part.layout.layer_stride
                in_group = np.repeat(np.arange(layers, dtype=np.int64), len(spans))
                lo = np.tile(spans[:, 0] * page, layers)
                columns[0].append(part.offset + in_group * stride + lo)
                columns[1].append(np.full(len(lo), stride, dtype=np.int64))
                columns[2].append(np.tile((spans[:, 1] - spans[:, 0]) * page, layers))
            empty = np.zeros(0, dtype=np.int64)
            base, strides, lengths = (np.concatenate(c) if c else empty for c in columns)
            grid = self._grids[key] = (base, strides, lengths)
        return grid

    def _spans(self, part: LeasePart, verify: bool) -> list[tuple[int, int]]:
        """[first, end) pages of ``part`` to read: whole checksum blocks when verifying."""
        key = (id(part), verify)  # the plan holds its parts, so their ids stay theirs
        spans = self._span_cache.get(key)
        if spans is None:
            spans = block_ranges(part) if verify else page_ranges(part)
            self._span_cache[key] = spans
        return spans

    # ---- mapped media: page runs in place ----------------------------------------------
    def _mapped_chunks(
        self, parts: list[LeasePart], layer: int, medium: Medium, access: MediumAccess
    ) -> list[LayerChunk]:
        chunks: list[LayerChunk] = []
        for part in parts:
            shape = self._mapped_shape(part, access.verify)
            base = part.extent_offset(layer)
            rows = shape.rows(part, layer, base)
            for run in shape.runs:
                if not chunks or chunks[-1].nbytes + run.nbytes > self.in_place_bytes:
                    chunks.append(LayerChunk(layer, medium, mapped=True))
                chunk = chunks[-1]
                # A block is checked with the chunk that copies its first pages: the reader
                # hashes those right after copying them (``restore/copy_check.py``).
                if rows is not None:
                    chunk.blocks.append(rows.at(slice(run.row_lo, run.row_hi)))
                chunk.runs.append(PageRun(layer, base + run.offset, run.positions, part.scope_id))
                chunk.scopes.add(part.scope_id)
                chunk.nbytes += run.nbytes
        for chunk in chunks:
            chunk.blocks = [BlockRows.joined(layer, chunk.blocks)] if chunk.blocks else []
        return chunks

    def _add_mapped(self, chunks: list[LayerChunk], chunk: LayerChunk) -> None:
        """Append ``chunk``, or (into host memory) join it to the mapped chunk before it of
        another layer while their bytes fit one batch: one batch of copies and checks."""
        last = chunks[-1] if chunks else None
        if (
            last is None
            or not (self.to_host and last.mapped and last.medium is chunk.medium)
            or last.nbytes + chunk.nbytes > self.in_place_bytes
        ):
            chunks.append(chunk)
            return
        last.runs.extend(chunk.runs)
        last.blocks.extend(chunk.blocks)
        last.scopes |= chunk.scopes
        last.nbytes += chunk.nbytes

    def _mapped_shape(self, part: LeasePart, verify: bool) -> MappedShape:
        """``part``'s runs and blocks, the same in every layer: found once per restore."""
        key = (id(part), verify)  # the plan holds its parts, so their ids stay theirs
        shape = self._shapes.get(key)
        if shape is None:
            longest = max(1, self.in_place_bytes // part.layout.page_bytes)
            if verify and longest >= part.layout.check_pages:  # cut runs between blocks
                longest -= longest % part.layout.check_pages
            shape = self._shapes[key] = MappedShape(part, longest, verify)
        return shape

    # ---- filled media: coalesced reads into slots ----------------------------------------
    def _filled_chunks(
        self, parts: list[LeasePart], first: int, end: int, medium: Medium, access: MediumAccess
    ) -> list[LayerChunk]:
        ranges = self._ranges(parts, first, end, medium, checks=True)
        reads = self._coalesce(ranges, access)
        members: list[list[WantedRange]] = [[] for _ in range(reads.count)]
        for i, item in enumerate(ranges):
            item.skip = int(reads.descriptor_skip[i])
            members[int(reads.descriptor_read[i])].append(item)
        chunks = [LayerChunk(first, medium, mapped=False)]
        for r in range(reads.count):
            src = int(reads.files[r]) * access.file_bytes + int(reads.offsets[r])
            group = sorted(members[r], key=lambda m: m.skip)
            self._stream(chunks, src, int(reads.lengths[r]), group, access.align)
        for chunk in chunks:  # layer order (stable: a block's spans stay in byte order)
            chunk.runs.sort(key=lambda run: run.layer)
            chunk.hashes.sort(key=lambda span: span.layer)
        return [c for c in chunks if c.reads]

    def _ranges(
        self,
        parts: list[LeasePart],
        first_layer: int,
        end_layer: int,
        medium: Medium,
        *,
        checks: bool,
    ) -> list[WantedRange]:
        """Wanted byte ranges (whole blocks when verifying); ``checks``: with their streaming
        checksums (reads only need the ranges: the replay model's segments hold no sums)."""
        verify = self.access[medium].verify
        ranges: list[WantedRange] = []
        for part in parts:
            spans = self._spans(part, verify)
            for layer in range(first_layer, end_layer):
                for first, end in spans:
                    ranges.append(self._range(part, layer, first, end, verify and checks))
        return ranges

    @staticmethod
    def _range(part: LeasePart, layer: int, first: int, end: int, checked: bool) -> WantedRange:
        layout = part.layout
        inside = (part.src_pages >= first) & (part.src_pages < end)
        lo, hi = first * layout.page_bytes, end * layout.page_bytes
        block_lo = block_hi = np.zeros(0, dtype=np.int64)
        block_sum = np.zeros(0, dtype=np.uint64)
        if checked:
            assert part.checksums is not None  # a live segment: written with its sums
            step = layout.check_pages
            blocks = np.arange(first // step, -(-end // step), dtype=np.int64)
            block_lo = blocks * step * layout.page_bytes - lo
            block_hi = np.minimum((blocks + 1) * step, layout.pages) * layout.page_bytes - lo
            block_sum = np.asarray(part.checksums[layer, blocks], dtype=np.uint64)
        return WantedRange(
            part, layer, lo, hi, part.src_pages[inside], part.dst_positions[inside],
            block_lo, block_hi, block_sum,
        )  # fmt: skip

    def _coalesce(self, ranges: list[WantedRange], access: MediumAccess) -> CoalescedReads:
        offsets = np.array([r.part.extent_offset(r.layer) + r.lo for r in ranges], dtype=np.int64)
        lengths = np.array([r.hi - r.lo for r in ranges], dtype=np.int64)
        return self._coalesce_bytes(offsets, lengths, access)

    def _coalesce_bytes(
        self, offsets: np.ndarray, lengths: np.ndarray, access: MediumAccess
    ) -> CoalescedReads:
        files, in_file = np.divmod(offsets, access.file_bytes)
        return coalesce(
            files,
            in_file,
            lengths,
            gap_bytes=access.gap_bytes,
            max_read_bytes=self.capacity,
            align=access.align,
        )

    def _stream(
        self,
        chunks: list[LayerChunk],
        src: int,
        length: int,
        members: list[WantedRange],
        align: int,
    ) -> None:
        """Cut one coalesced read into pieces that fit the slots, appending to ``chunks``."""
        start = 0
        while start < length:
            room = self.capacity - chunks[-1].nbytes
            if room < min(length - start, self.capacity):
                chunks.append(LayerChunk(chunks[-1].first_layer, chunks[-1].medium, mapped=False))
                room = self.capacity
            end = min(length, start + room)
            chunk = chunks[-1]
            base = chunk.nbytes - start  # slot offset of read byte 0 for this piece
            chunk.reads.append(SlotRead(src + start, end - start, chunk.nbytes))
            chunk.nbytes += end - start
            cut = None
            for member in members:
                if member.skip < end and member.skip + (member.hi - member.lo) > start:
                    chunk.scopes.add(member.part.scope_id)
                cut = cut_piece(chunk, member, end, base, cut)
            start = align_down(cut, align) if cut is not None else end
