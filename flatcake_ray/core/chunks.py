"""What one restore chunk carries through a slot, and how a wanted range is cut into the
chunks' pieces: the planner's data (:class:`SlotRead`, :class:`PageRun`,
:class:`LayerChunk`) and its per-range cutting (:func:`cut_piece`, :func:`feed_checks`),
used by :class:`~flatcake_ray.core.plan.RestorePlan`, which says how chunks are chosen."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flatcake_ray.core.block_checks import BlockRows, HashSpan, RowsByOffset
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.integrity import StreamingCheck
from flatcake_ray.core.parts import LeasePart
from flatcake_ray.core.runs import run_bounds


@dataclass(frozen=True)
class SlotRead:
    src: int  # medium-local offset
    length: int
    slot_offset: int


@dataclass(frozen=True)
class PageRun:
    """Pages of ``layer`` back to back in a chunk's source, bound for ``positions`` in order."""

    layer: int
    offset: int  # bytes into the chunk's source
    positions: np.ndarray
    scope_id: int


@dataclass
class LayerChunk:
    first_layer: int  # the first layer of the group this chunk belongs to
    medium: Medium
    mapped: bool  # the source is the mapped medium (offsets are medium offsets), else the slot
    nbytes: int = 0  # bytes of the slot used (mapped: bytes of its runs)
    reads: list[SlotRead] = field(default_factory=list)
    hashes: list[HashSpan] = field(default_factory=list)  # blocks a slot cuts: in pieces
    blocks: list[BlockRows] = field(default_factory=list)  # whole blocks, as rows
    runs: list[PageRun] = field(default_factory=list)
    scopes: set[int] = field(default_factory=set)  # whose bytes this chunk carries
    done_layer: int | None = None  # every layer up to this one is in place after this chunk

    @property
    def checked(self) -> bool:
        return bool(self.hashes) or any(len(rows) for rows in self.blocks)

    def all_spans(self) -> list[HashSpan]:
        """Every check of the chunk as spans (a mapped chunk's rows made into objects)."""
        return self.hashes + [span for rows in self.blocks for span in rows.spans()]


@dataclass
class WantedRange:
    """Wanted bytes ``[lo, hi)`` of one part's layer extent, streaming through pieces."""

    part: LeasePart
    layer: int
    lo: int
    hi: int
    src: np.ndarray  # wanted pages inside, ascending
    positions: np.ndarray
    block_lo: np.ndarray  # per checksum block: range-relative [lo, hi) bytes, its sum
    block_hi: np.ndarray
    block_sum: np.ndarray
    # The checks of blocks cut by a piece's end, fed piece by piece (a few a restore).
    split: dict[int, StreamingCheck] = field(default_factory=dict)
    skip: int = 0  # byte offset of ``lo`` inside its coalesced read
    delivered: int = 0  # wanted pages handed out so far
    hashed: int = 0  # range bytes fed to the checks so far
    next_check: int = 0


def cut_piece(
    chunk: LayerChunk, member: WantedRange, end: int, base: int, cut: int | None
) -> int | None:
    """Hash and deliver what of ``member`` lies before read byte ``end``; returns the start
    of the first wanted page cut in two by ``end`` (the next piece starts at it).

    Such a page is delivered from the next piece, which reads it again whole, so its bytes
    are hashed there too, not here: a check fed from this piece's copy of them would pass
    whatever the next read brought (a write to the drive between the two reads was
    delivered unchecked)."""
    page_bytes = member.part.layout.page_bytes
    limit = (end - member.skip + member.lo) // page_bytes  # pages ending by ``end``
    stop = int(np.searchsorted(member.src, limit, side="left"))
    cut_here = None  # the start of a wanted page that ``end`` cuts in two
    after = max(member.delivered, stop)
    if after < len(member.src):
        page_start = member.skip + int(member.src[after]) * page_bytes - member.lo
        cut_here = page_start if page_start < end else None
    feed_checks(chunk, member, end if cut_here is None else cut_here, base)
    first = member.delivered
    for run_start, run_stop in run_bounds(member.src[first:stop]):
        page = int(member.src[first + run_start])
        chunk.runs.append(
            PageRun(
                member.layer,
                base + member.skip + page * page_bytes - member.lo,
                member.positions[first + run_start : first + run_stop],
                member.part.scope_id,
            )
        )
    member.delivered = max(first, stop)
    return cut if cut is not None else cut_here


def feed_checks(chunk: LayerChunk, member: WantedRange, end: int, base: int) -> None:
    """The checks of ``member``'s blocks from where hashing stopped up to read byte ``end``:
    the blocks that lie whole in this piece as rows (thousands a restore: arrays, not an
    object each), and a span each for a block begun in an earlier piece or cut by ``end``."""
    stop = min(end - member.skip, member.hi - member.lo)  # range-relative
    index, hashed, count = member.next_check, member.hashed, len(member.block_lo)
    at, layer, scope = base + member.skip, member.layer, member.part.scope_id
    if index < count and hashed < stop and hashed > member.block_lo[index]:  # goes on
        check, block_end = member.split[index], int(member.block_hi[index])
        last = block_end <= stop
        length = (block_end if last else stop) - hashed
        chunk.hashes.append(HashSpan(layer, check, at + hashed, length, last))
        hashed += length
        index += last
    if index < count and hashed < stop:
        whole = index + int(np.searchsorted(member.block_hi[index:], stop, side="right"))
        if whole > index:
            rows = slice(index, whole)
            lo, hi = member.block_lo[rows], member.block_hi[rows]
            sums = member.block_sum[rows]
            scopes = np.full(whole - index, scope, dtype=np.int64)
            chunk.blocks.append(BlockRows(layer, at + lo, hi - lo, sums, scopes))
            hashed, index = int(hi[-1]), whole
        if index < count and member.block_lo[index] < stop:  # cut by this piece's end
            check = member.split[index] = StreamingCheck(int(member.block_sum[index]), scope)
            start = max(int(member.block_lo[index]), hashed)
            chunk.hashes.append(HashSpan(layer, check, at + start, stop - start, False))
            hashed = stop
    member.next_check, member.hashed = index, hashed


@dataclass(frozen=True)
class MappedRun:
    """One page run of a part read in place, as it is in every layer: ``offset`` bytes past
    the layer's extent, rows ``[row_lo, row_hi)`` of the part's blocks checked with it."""

    offset: int
    nbytes: int
    positions: np.ndarray
    row_lo: int
    row_hi: int


class MappedShape:
    """What planning a mapped part finds that no layer changes: its page runs (each at most
    ``longest`` pages) and the checksum blocks each run checks. A restore plans every layer
    of a part from it (``RestorePlan._mapped_chunks``); only the extent's offset and the
    blocks' sums differ from layer to layer."""

    def __init__(self, part: LeasePart, longest: int, verify: bool) -> None:
        layout = part.layout
        self.blocks = np.unique(part.src_pages // layout.check_pages) if verify else None
        rows = None
        if self.blocks is not None:
            first = self.blocks * layout.check_pages
            end = np.minimum(first + layout.check_pages, layout.pages)
            self.block_offset = first * layout.page_bytes
            self.block_length = (end - first) * layout.page_bytes
            self.block_scope = np.full(len(self.blocks), part.scope_id, dtype=np.int64)
            rows = RowsByOffset(self.block_offset, self.block_length)
        self.runs: list[MappedRun] = []
        for start, stop in run_bounds(part.src_pages, longest):
            offset = int(part.src_pages[start]) * layout.page_bytes
            nbytes = (stop - start) * layout.page_bytes
            taken = (0, 0) if rows is None else rows.take(offset, offset + nbytes)
            self.runs.append(MappedRun(offset, nbytes, part.dst_positions[start:stop], *taken))

    def rows(self, part: LeasePart, layer: int, base: int) -> BlockRows | None:
        """The part's blocks of ``layer`` (its extent at medium offset ``base``), as rows."""
        if self.blocks is None:
            return None
        assert part.checksums is not None  # a live segment: written with its sums
        expected = np.asarray(part.checksums[layer, self.blocks], dtype=np.uint64)
        return BlockRows(
            layer, base + self.block_offset, self.block_length, expected, self.block_scope
        )
