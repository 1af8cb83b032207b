"""Sort-merge coalescing of read descriptors (FC-CIO's read-time half). A pure function.

Descriptors are byte ranges ``(file, offset, length)``. They are sorted by ``(file, offset)``,
widened to the alignment (4 KiB for O_DIRECT), and merged with their neighbours when the hole
between them is smaller than ``gap_bytes`` (the bridged bytes are read and dropped: a bounded
amount of extra sequential bytes beats another NVMe command). A merged read never exceeds
``max_read_bytes`` (unless one descriptor alone does), so a staging buffer of that size holds
any read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FILE_SHIFT = 48  # offsets are 48-bit, so (file << 48 | offset) orders by file then offset


@dataclass(frozen=True)
class CoalescedReads:
    """Merged reads, and where each input descriptor lands inside them."""

    files: np.ndarray  # per read
    offsets: np.ndarray  # per read, aligned
    lengths: np.ndarray  # per read, aligned
    descriptor_read: np.ndarray  # per input descriptor: index of the read that holds it
    descriptor_skip: np.ndarray  # per input descriptor: its byte offset inside that read

    @property
    def count(self) -> int:
        return len(self.offsets)

    @property
    def bytes(self) -> int:
        return int(self.lengths.sum())


def coalesce(
    files: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    *,
    gap_bytes: int = 64 << 10,
    max_read_bytes: int | None = None,
    align: int = 1,
) -> CoalescedReads:
    files = np.asarray(files, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if not len(files) == len(offsets) == len(lengths):
        raise ValueError("files, offsets and lengths must have one entry per descriptor")
    if len(offsets) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return CoalescedReads(empty, empty, empty, empty, empty)
    if (offsets < 0).any() or (lengths <= 0).any() or (files < 0).any():
        raise ValueError("descriptors need offset >= 0, length > 0 and file >= 0")
    starts = (files << FILE_SHIFT) | (offsets // align * align)
    ends = (files << FILE_SHIFT) | (-(-(offsets + lengths) // align) * align)
    order = np.argsort(starts, kind="stable")
    sorted_starts, sorted_ends = starts[order], ends[order]
    reach = np.maximum.accumulate(sorted_ends)
    hole = sorted_starts[1:] - reach[:-1]
    breaks = np.flatnonzero(hole >= max(gap_bytes, 1) if gap_bytes else hole > 0) + 1
    group_first = np.concatenate(([0], breaks))
    if max_read_bytes is not None:
        group_first = _split_long_groups(group_first, sorted_starts, sorted_ends, max_read_bytes)
    group_of_sorted = np.repeat(
        np.arange(len(group_first)), np.diff(np.append(group_first, len(order)))
    )
    group_starts = sorted_starts[group_first]
    group_ends = np.maximum.reduceat(sorted_ends, group_first)
    descriptor_read = np.empty(len(order), dtype=np.int64)
    descriptor_read[order] = group_of_sorted
    descriptor_skip = ((files << FILE_SHIFT) | offsets) - group_starts[descriptor_read]
    mask = (1 << FILE_SHIFT) - 1
    return CoalescedReads(
        files=group_starts >> FILE_SHIFT,
        offsets=group_starts & mask,
        lengths=group_ends - group_starts,
        descriptor_read=descriptor_read,
        descriptor_skip=descriptor_skip,
    )


def _split_long_groups(
    group_first: np.ndarray, starts: np.ndarray, ends: np.ndarray, limit: int
) -> np.ndarray:
    """Cut merged groups longer than ``limit`` at descriptor boundaries (greedy)."""
    bounds = np.append(group_first, len(starts))
    spans = np.maximum.reduceat(ends, group_first) - starts[group_first]
    if (spans <= limit).all():
        return group_first
    cuts: list[int] = []
    for g, first in enumerate(group_first):
        cuts.append(int(first))
        if spans[g] <= limit:
            continue
        read_start, reach = starts[first], ends[first]
        for i in range(first + 1, bounds[g + 1]):
            if max(reach, ends[i]) - read_start > limit:
                cuts.append(i)
                read_start, reach = starts[i], ends[i]
            else:
                reach = max(reach, ends[i])
    return np.asarray(cuts, dtype=np.int64)
