"""Small arithmetic idioms shared by every floor: alignment, runs of consecutive numbers, and
whether ranges lie in a set of chunks."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np

from flatcake_ray.config import ALIGN


def align_up(value: int, alignment: int = ALIGN) -> int:
    return -(-value // alignment) * alignment


def align_down(value: int, alignment: int = ALIGN) -> int:
    return value // alignment * alignment


def spans_cover(chunks: Iterable[tuple[int, int]], starts: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether every range ``[start, start + length)`` lies inside the ``(offset, bytes)``
    chunks, chunks back to back joined (a range may cross from one into the next)."""
    if not len(starts):
        return True
    spans: list[list[int]] = []
    for offset, nbytes in sorted(chunks):
        if spans and spans[-1][1] == offset:
            spans[-1][1] += nbytes
        else:
            spans.append([offset, offset + nbytes])
    if not spans:
        return False
    table = np.array(spans, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    at = np.searchsorted(table[:, 0], starts, side="right") - 1
    ends = starts + np.asarray(lengths, dtype=np.int64)
    return bool(((at >= 0) & (ends <= table[at.clip(0), 1])).all())


def run_bounds(values: np.ndarray, max_len: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) index ranges of ``values`` that go up by one, each at most ``max_len``."""
    if not len(values):
        return []
    cuts = np.flatnonzero(np.diff(values) != 1) + 1
    bounds = [0, *cuts.tolist(), len(values)]
    if max_len is None:
        return list(itertools.pairwise(bounds))
    spans: list[tuple[int, int]] = []
    for start, stop in itertools.pairwise(bounds):
        spans.extend((s, min(s + max_len, stop)) for s in range(start, stop, max_len))
    return spans


def paired_run_bounds(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) index ranges where ``src`` and ``dst`` both go up by one."""
    if not len(src):
        return []
    cuts = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    return list(itertools.pairwise([0, *cuts.tolist(), len(src)]))
