"""A checked chunk of the mapped arena copied into the reader's memory and checked there in
one pass: each whole checksum block that lies in one run is hashed right after its copy,
while its bytes are in cache (``cuda_ext/_copyhash.c``), instead of a copy of the chunk and
then a second pass over memory to hash it.

``ChunkDelivery._deliver_then_check`` calls :func:`copy_and_check`; the spans it leaves (a
block fed in several pieces, or one across two runs or past the chunk's runs) are checked
after it by the usual path, from the delivered bytes and the medium.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flatcake_ray.core.block_checks import BlockRows, HashSpan
from flatcake_ray.core.chunks import LayerChunk, PageRun
from flatcake_ray.cuda_ext.host_copy import DST, HASH_AT, op_rows
from flatcake_ray.cuda_ext.host_hash import copy_and_hash, copy_and_hash_pieces, fused, pieces_pass
from flatcake_ray.restore.dest import Destination


@dataclass(frozen=True)
class ChunkChecks:
    """The checks of a chunk, as rows: the whole blocks the plan gave as rows
    first, then one row per span (a block fed in pieces across slots; kept, in order)."""

    rows: BlockRows
    whole: np.ndarray  # bool: the row is a whole block in one span, not started
    spans: list[HashSpan]  # the rows from ``block_rows`` on, as the plan made them
    block_rows: int  # rows before this one are the plan's whole-block rows

    @classmethod
    def of(cls, chunk: LayerChunk) -> ChunkChecks:
        """Every check of ``chunk``, all its layers (a chunk is copied and checked in one
        batch); the rows carry the chunk's first layer: the spans made of them are only fed
        and decided."""
        blocks = BlockRows.joined(chunk.first_layer, chunk.blocks)
        spans = list(chunk.hashes)
        if not spans:
            return cls(blocks, np.ones(len(blocks), dtype=bool), [], len(blocks))
        rows = BlockRows(
            blocks.layer,
            np.concatenate([blocks.offset, [span.offset for span in spans]]).astype(np.int64),
            np.concatenate([blocks.length, [span.length for span in spans]]).astype(np.int64),
            np.concatenate(
                [blocks.expected, np.array([s.check.expected for s in spans], dtype=np.uint64)]
            ),
            np.concatenate([blocks.scope, [span.check.scope_id for span in spans]]).astype(
                np.int64
            ),
        )
        fresh = [span.last and not span.check.started for span in spans]
        whole = np.concatenate([np.ones(len(blocks), dtype=bool), np.array(fresh, dtype=bool)])
        return cls(rows, whole, spans, len(blocks))

    def spans_at(self, index: np.ndarray) -> list[HashSpan]:
        """The checks at ``index`` (ascending) as spans: whole-block rows made into spans,
        the others as the plan made them (a block's streaming check goes on)."""
        planned = index >= self.block_rows
        made = self.rows.at(index[~planned]).spans()
        return made + [self.spans[i - self.block_rows] for i in index[planned].tolist()]


@dataclass(frozen=True)
class CopyChecked:
    failed: np.ndarray  # indexes of rows hashed after the copy, and wrong
    left: np.ndarray  # indexes of rows not hashed here, ascending: the caller checks them


def copy_and_check(
    medium: np.ndarray,
    runs: list[PageRun],
    targets: dict[int, np.ndarray],
    checks: ChunkChecks,
    page_bytes: int,
) -> CopyChecked | None:
    """Copy each of ``runs`` from ``medium`` into its target piece (``targets[id(run)]``) and
    hash the whole blocks of ``checks`` that lie inside one run as they are copied. None, with
    nothing copied, where the fused native pass is not built."""
    if not fused():
        return None
    ordered = sorted(runs, key=lambda run: run.offset)
    lengths = np.array([len(run.positions) for run in ordered], dtype=np.int64) * page_bytes
    run_lo = np.array([run.offset for run in ordered], dtype=np.int64)
    run_hi = run_lo + lengths
    bases = np.array(
        [_address(targets[id(run)], int(n)) for run, n in zip(ordered, lengths, strict=True)],
        dtype=np.int64,
    )
    if len(ordered) and (run_lo[0] < 0 or int(run_hi.max()) > medium.nbytes):
        raise AssertionError("a page run lies outside the mapped medium")
    rows = checks.rows
    inside = _whole_inside(rows, checks.whole, run_lo, run_hi)
    hashed = np.flatnonzero(inside)
    span_lo = rows.offset[hashed]
    span_hi = span_lo + rows.length[hashed]
    # Pieces: the runs cut at the hashed blocks' ends, so each hashed block is one piece.
    cuts = np.unique(np.concatenate([run_lo, run_hi, span_lo, span_hi]))
    lo, hi = cuts[:-1], cuts[1:]
    owner = np.searchsorted(run_lo, lo, side="right") - 1
    kept = (owner >= 0) & (hi <= run_hi[np.maximum(owner, 0)])
    lo, hi, owner = lo[kept], hi[kept], owner[kept]
    ops = op_rows(bases[owner] + (lo - run_lo[owner]), medium.ctypes.data + lo, hi - lo)
    piece_of_span = np.searchsorted(lo, span_lo)
    ops[piece_of_span, HASH_AT] = ops[piece_of_span, DST]
    sums = copy_and_hash(ops)
    assert sums is not None  # fused() said the native pass is there
    wrong = sums[piece_of_span] != rows.expected[hashed]
    return CopyChecked(hashed[wrong], np.flatnonzero(~inside))


def _address(piece: np.ndarray, nbytes: int) -> int:
    """Where a run's target piece starts, once it is known to hold the run's bytes."""
    if not piece.flags.c_contiguous or piece.nbytes != nbytes:
        raise AssertionError("a run's target is not one contiguous piece of its length")
    return int(piece.ctypes.data)


def _whole_inside(
    rows: BlockRows, whole: np.ndarray, run_lo: np.ndarray, run_hi: np.ndarray
) -> np.ndarray:
    """Per row: a whole block that lies inside one run (hashed as it is copied)."""
    if not len(run_lo) or not len(rows):
        return np.zeros(len(rows), dtype=bool)
    ends = rows.offset + rows.length
    owner = np.searchsorted(run_lo, rows.offset, side="right") - 1
    return whole & (owner >= 0) & (ends <= run_hi[np.maximum(owner, 0)])


def copy_blocks_checked(medium: np.ndarray, rows: BlockRows, into: np.ndarray) -> np.ndarray | None:
    """Copy each block of ``rows`` (sorted by offset) from ``medium`` into ``into`` at its
    offset past the first block's, hashing it as it is copied; returns per row whether its
    sum is wrong. None, with nothing copied, where the fused native pass is not built."""
    if not fused():
        return None
    lo = int(rows.offset[0])
    ends = rows.offset + rows.length
    if lo < 0 or int(ends.max()) > medium.nbytes or int(ends.max()) - lo > into.nbytes:
        raise AssertionError("a block lies outside the mapped medium or its copy")
    copies = into.ctypes.data + (rows.offset - lo)
    sums = copy_and_hash(op_rows(copies, medium.ctypes.data + rows.offset, rows.length, copies))
    assert sums is not None  # fused() said the native pass is there
    return sums != rows.expected


def copy_into_pieces(
    source: np.ndarray, rows: BlockRows, runs: list[PageRun], dest: Destination, page_bytes: int
) -> np.ndarray | None:
    """Copy each block of ``rows`` (whole checksum blocks of ``source``, the mapped medium or
    a filled host slot, sorted by offset) straight into the host pieces where its pages go
    (``dest``'s, for ``runs``; a block's pages no run takes go to a private sink) and hash it
    in the same pass; returns per row whether its sum is wrong. What is hashed is what the
    pieces hold. None, with nothing copied, where this pass does not apply: not built or no
    AVX2, a device, pieces not a multiple of 64 bytes, a short block or one not of whole
    pages, a run's page outside every block."""
    if not runs or not len(rows) or not pieces_pass():
        return None
    found = _pieces_of(runs, dest, page_bytes)
    if found is None or int(rows.length.min()) <= 240 or np.any(rows.length % page_bytes):
        return None
    offsets, addresses, piece_bytes = found
    per_page = page_bytes // piece_bytes
    per_row = rows.length // page_bytes
    starts = np.cumsum(per_row) - per_row
    pages = np.repeat(rows.offset, per_row) + page_bytes * (
        np.arange(int(per_row.sum()), dtype=np.int64) - np.repeat(starts, per_row)
    )
    if not _all_inside(offsets, pages):
        return None
    at = np.minimum(np.searchsorted(offsets, pages), len(offsets) - 1)
    taken = offsets[at] == pages
    table = np.empty((len(pages), per_page), dtype=np.int64)
    table[taken] = addresses[at[taken]]
    sink = np.empty(int((~taken).sum()) * page_bytes, dtype=np.uint8)  # alive until copied
    table[~taken] = sink.ctypes.data + (
        np.arange(len(sink) // page_bytes, dtype=np.int64)[:, None] * page_bytes
        + np.arange(per_page, dtype=np.int64)[None, :] * piece_bytes
    )
    if int(rows.offset.min()) < 0 or int((rows.offset + rows.length).max()) > source.nbytes:
        raise AssertionError("a block lies outside the chunk's source")
    ops = np.stack(
        [
            source.ctypes.data + rows.offset,
            rows.length,
            starts * per_page,
            np.full(len(rows), piece_bytes, dtype=np.int64),
        ],
        axis=1,
    )
    return copy_and_hash_pieces(ops, table.reshape(-1)) != rows.expected


def _pieces_of(
    runs: list[PageRun], dest: Destination, page_bytes: int
) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(each taken page's source offset, ascending; its pieces' addresses, a row a page;
    the piece size), or None where a run has no host pieces, the runs' pieces differ in size
    or are not whole multiples of 64 bytes, or two runs take one page."""
    offsets, addresses, piece_bytes = [], [], 0
    for run in runs:
        where = dest.host_pieces(run.layer, run.positions)
        if where is None or piece_bytes not in (0, where.piece_bytes):
            return None
        piece_bytes = where.piece_bytes
        offsets.append(run.offset + page_bytes * np.arange(len(run.positions), dtype=np.int64))
        addresses.append(where.addresses)
    if piece_bytes % 64 or page_bytes % piece_bytes:
        return None
    offset = np.concatenate(offsets)
    order = np.argsort(offset, kind="stable")
    offset = offset[order]
    if len(offset) > 1 and not bool(np.all(np.diff(offset) > 0)):
        return None
    table = np.concatenate(addresses).reshape(len(order), page_bytes // piece_bytes)[order]
    return offset, table, piece_bytes


def _all_inside(offsets: np.ndarray, pages: np.ndarray) -> bool:
    """Every taken page (``offsets``) is one of the blocks' ``pages`` (both ascending)."""
    at = np.minimum(np.searchsorted(pages, offsets), len(pages) - 1)
    return bool(np.all(pages[at] == offsets))
