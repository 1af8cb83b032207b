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

from flatcake_ray.core.plan import HashSpan, PageRun
from flatcake_ray.cuda_ext.host_hash import DST, HASH_AT, LENGTH, SRC, copy_and_hash, fused


@dataclass(frozen=True)
class CopyChecked:
    failed: list[HashSpan]  # hashed after the copy, and wrong
    left: list[HashSpan]  # not hashed here: the caller checks them (in their order)


def copy_and_check(
    medium: np.ndarray,
    runs: list[PageRun],
    targets: dict[int, np.ndarray],
    spans: list[HashSpan],
    page_bytes: int,
) -> CopyChecked | None:
    """Copy each of ``runs`` from ``medium`` into its target piece (``targets[id(run)]``) and
    hash the whole blocks of ``spans`` that lie inside one run as they are copied. None, with
    nothing copied, where the fused native pass is not built."""
    if not fused():
        return None
    ordered = sorted(runs, key=lambda run: run.offset)
    lengths = [len(run.positions) * page_bytes for run in ordered]
    run_lo = np.array([run.offset for run in ordered], dtype=np.int64)
    run_hi = run_lo + np.array(lengths, dtype=np.int64)
    bases = np.array(
        [_address(targets[id(run)], n) for run, n in zip(ordered, lengths, strict=True)],
        dtype=np.int64,
    )
    if len(ordered) and (run_lo[0] < 0 or int(run_hi.max()) > medium.nbytes):
        raise AssertionError("a page run lies outside the mapped medium")
    hashed, left = _whole_inside(spans, run_lo, run_hi)
    span_lo = np.array([span.offset for span in hashed], dtype=np.int64)
    span_hi = span_lo + np.array([span.length for span in hashed], dtype=np.int64)
    # Pieces: the runs cut at the hashed blocks' ends, so each hashed block is one piece.
    cuts = np.unique(np.concatenate([run_lo, run_hi, span_lo, span_hi]))
    lo, hi = cuts[:-1], cuts[1:]
    owner = np.searchsorted(run_lo, lo, side="right") - 1
    inside = (owner >= 0) & (hi <= run_hi[np.maximum(owner, 0)])
    lo, hi, owner = lo[inside], hi[inside], owner[inside]
    ops = np.zeros((len(lo), 4), dtype=np.int64)
    ops[:, DST] = bases[owner] + (lo - run_lo[owner])
    ops[:, SRC] = medium.ctypes.data + lo
    ops[:, LENGTH] = hi - lo
    piece_of_span = np.searchsorted(lo, span_lo)
    ops[piece_of_span, HASH_AT] = ops[piece_of_span, DST]
    sums = copy_and_hash(ops)
    assert sums is not None  # fused() said the native pass is there
    expected = np.array([span.check.expected for span in hashed], dtype=np.uint64)
    wrong = np.flatnonzero(sums[piece_of_span] != expected)
    return CopyChecked([hashed[index] for index in wrong.tolist()], left)


def _address(piece: np.ndarray, nbytes: int) -> int:
    """Where a run's target piece starts, once it is known to hold the run's bytes."""
    if not piece.flags.c_contiguous or piece.nbytes != nbytes:
        raise AssertionError("a run's target is not one contiguous piece of its length")
    return int(piece.ctypes.data)


def _whole_inside(
    spans: list[HashSpan], run_lo: np.ndarray, run_hi: np.ndarray
) -> tuple[list[HashSpan], list[HashSpan]]:
    """(whole blocks inside one run, the other spans), each in the order of ``spans``."""
    if not len(run_lo) or not spans:
        return [], list(spans)
    offsets = np.array([span.offset for span in spans], dtype=np.int64)
    ends = offsets + np.array([span.length for span in spans], dtype=np.int64)
    whole = np.array([span.last and not span.check.started for span in spans], dtype=bool)
    owner = np.searchsorted(run_lo, offsets, side="right") - 1
    inside = whole & (owner >= 0) & (ends <= run_hi[np.maximum(owner, 0)])
    hashed = [span for span, yes in zip(spans, inside.tolist(), strict=True) if yes]
    left = [span for span, yes in zip(spans, inside.tolist(), strict=True) if not yes]
    return hashed, left
