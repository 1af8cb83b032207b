"""Local DRAM: memcpy from this node's DRAM arena, mapped read-only into the reader.

The storage node owns the arena (a file in /dev/shm or on hugetlbfs); a client on the same
node maps the same file read-only (:meth:`DramArena.attach`) and copies pages straight out
of it. Nothing crosses a process boundary but the lease that says where the pages are.
A copy to a GPU is the caller's torch copy on a stream (see ``flatcake_ray/buffers.py``).

Also here: :func:`merge_contiguous`, shared by every transport, which folds ranges that are
back to back in both source and destination into one (one memcpy, one NIXL descriptor).
"""

from __future__ import annotations

import time

import numpy as np

from flatcake_ray.errors import TransportClosedError
from flatcake_ray.media.arena import DramArena
from flatcake_ray.transports.base import LOCAL_DRAM, ReadBatch, TransferStats, Transport


def merge_contiguous(batch: ReadBatch) -> ReadBatch:
    """The same copies with ranges that continue each other (source and destination) merged.

    Keeps the order of the batch; only neighbours in the given order are merged.
    """
    batch = batch.nonempty()
    if len(batch) < 2:
        return batch
    src, lengths, dst = batch.src_offsets, batch.lengths, batch.dst_offsets
    continues = (src[1:] == src[:-1] + lengths[:-1]) & (dst[1:] == dst[:-1] + lengths[:-1])
    if not continues.any():
        return batch
    starts = np.concatenate(([0], np.flatnonzero(~continues) + 1))
    merged_lengths = np.add.reduceat(lengths, starts)
    return ReadBatch(src[starts], merged_lengths, dst[starts])


def copy_ranges(source: np.ndarray, batch: ReadBatch, dst: np.ndarray) -> int:
    """memcpy each range of ``batch`` from ``source`` into ``dst``; returns the copies made."""
    for s, n, d in zip(
        batch.src_offsets.tolist(), batch.lengths.tolist(), batch.dst_offsets.tolist(), strict=True
    ):
        dst[d : d + n] = source[s : s + n]
    return len(batch)


class LocalDramTransport(Transport):
    """Reads ranges of a DRAM arena this process can map: offsets are arena offsets."""

    name = LOCAL_DRAM

    def __init__(self, arena_view: np.ndarray, *, mapping: object = None) -> None:
        self._view: np.ndarray | None = arena_view
        self._mapping = mapping  # keeps an attached mapping alive while the view is used

    @classmethod
    def attach(cls, arena_path: str, arena_bytes: int) -> LocalDramTransport:
        """Map another process's arena read-only (the client's local-DRAM path)."""
        mapping, view = DramArena.attach(arena_path, arena_bytes)
        return cls(view, mapping=mapping)

    @classmethod
    def probe(cls) -> str | None:
        return None  # plain memory: always usable

    def mapped_view(self) -> np.ndarray | None:
        return self._view

    def read(self, reads: ReadBatch, dst: np.ndarray) -> TransferStats:
        if self._view is None:
            raise TransportClosedError("local-dram transport is closed")
        reads.check_destination(dst)
        reads.check_source(self._view.size, "the local DRAM arena")
        start = time.perf_counter()
        merged = merge_contiguous(reads)
        commands = copy_ranges(self._view, merged, dst)
        return TransferStats(merged.total_bytes, commands, time.perf_counter() - start, self.name)

    def close(self) -> None:
        # Dropping the view and the mapping object unmaps once no other view is alive;
        # mmap.close() would raise BufferError while a caller still holds a slice.
        self._view = None
        self._mapping = None
