"""Local DRAM: memcpy from this node's DRAM arena, mapped read-only into the reader.

The storage node owns the arena (chunk memfds, no path); a client on the same node maps the
chunks its tenant was handed (as descriptors, ``media/fd_handout.py``) privately, each at
its arena offset in one reserved range (:class:`ChunkMap`), and copies pages straight out of
them. A range outside them is :class:`ForeignMemoryError` (a miss), after one more hand-out
of the chunks its tenant holds now (it may have taken more since). A chunk that changed
tenants since it was mapped has a fresh file (``media/chunk_files.py``): the reader keeps
each chunk's descriptor, sees the old one retired, and maps the chunk anew before it reads
there. Nothing crosses a process boundary but the lease that says where the pages are.
A copy to a GPU is the caller's torch copy on a stream (see ``flatcake_ray/buffers.py``).

Also here, shared by every transport: :func:`merge_contiguous`, which folds ranges that are
back to back in both source and destination into one (one memcpy, one NIXL descriptor), and
:func:`split_at`, which cuts them where a registration ends.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

from flatcake_ray.errors import ForeignMemoryError, TransportClosedError
from flatcake_ray.media.chunk_files import is_retired
from flatcake_ray.media.chunk_map import ChunkMap
from flatcake_ray.media.fd_handout import HandedChunk
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


def split_at(batch: ReadBatch, bounds: np.ndarray) -> ReadBatch:
    """The same copies, each range cut where it crosses one of ``bounds`` (source offsets):
    a NIXL transfer descriptor, or an RDMA work request, lies inside one registration."""
    src, lengths, dst = batch.src_offsets, batch.lengths, batch.dst_offsets
    if not len(src) or not len(bounds):
        return batch
    bounds = np.sort(bounds)
    crossing = np.searchsorted(bounds, src + lengths, "left") > np.searchsorted(
        bounds, src, "right"
    )
    if not crossing.any():
        return batch
    pieces: list[tuple[int, int, int]] = []
    for s, n, d, cut in zip(
        src.tolist(), lengths.tolist(), dst.tolist(), crossing.tolist(), strict=True
    ):
        edges = [s, *(int(b) for b in bounds if s < b < s + n), s + n] if cut else [s, s + n]
        pieces += [(a, b - a, d + a - s) for a, b in itertools.pairwise(edges)]
    columns = np.array(pieces, dtype=np.int64).T
    return ReadBatch(columns[0], columns[1], columns[2])


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

    def __init__(
        self,
        arena_view: np.ndarray,
        *,
        chunks: ChunkMap | None = None,
        hand: Callable[[], Iterable[HandedChunk]] | None = None,
    ) -> None:
        self._view: np.ndarray | None = arena_view
        self._chunks = chunks  # None: the whole view is this process's to read
        self._hand = hand
        self._fds: dict[int, int] = {}  # offset -> descriptor of each chunk mapped
        self._lock = threading.Lock()

    @classmethod
    def attach(
        cls, hand: Callable[[], Iterable[HandedChunk]], arena_bytes: int
    ) -> LocalDramTransport:
        """Map the arena chunks another process hands this one (the client's local-DRAM
        path): ``hand`` answers the chunks its tenant holds now (asked again when a read
        reaches past them: the tenant grew)."""
        mapped = ChunkMap(arena_bytes)
        transport = cls(mapped.view, chunks=mapped, hand=hand)
        transport._map(hand())
        return transport

    def _map(self, handed: Iterable[HandedChunk]) -> None:
        assert self._chunks is not None
        kept: list[int] = []
        chunks = list(handed)
        try:
            for chunk in chunks:
                if chunk.offset not in self._chunks.mapped:
                    self._chunks.place(chunk.offset, chunk.fd, chunk.nbytes, shared=False)
                    self._fds[chunk.offset] = chunk.fd  # to see it retired
                    kept.append(chunk.fd)
        finally:
            for chunk in chunks:
                if chunk.fd not in kept:
                    os.close(chunk.fd)

    def learn(self, handed: Iterable[HandedChunk]) -> None:
        """Chunks handed to this process another way (a put's ticket named them: the client's
        put mapped them), mapped here now, so that a read there asks the node nothing (asking
        was 3-6 ms of a restore in an engine that saves, then reads back, each new chunk).
        Takes the descriptors (a chunk already mapped from its current file: closed)."""
        chunks = list(handed)
        if self._chunks is None:
            for chunk in chunks:
                os.close(chunk.fd)
            return
        with self._lock:
            fds = self._fds
            self._drop([c.offset for c in chunks if c.offset in fds and is_retired(fds[c.offset])])
            self._map(chunks)

    def holds(self, starts: np.ndarray, lengths: np.ndarray) -> bool:
        """Whether every range lies in chunks handed to this process and mapped from their
        current files (looking once for chunks handed since, or renewed): only then may its
        :meth:`mapped_view` be read there."""
        chunks = self._chunks
        if chunks is None:
            return True
        with self._lock:
            stale = self._retired(starts, lengths)
            if not stale and chunks.covers(starts, lengths):
                return True
            self._drop(stale)
            if self._hand is not None:
                self._map(self._hand())
            return chunks.covers(starts, lengths)

    def _drop(self, offsets: list[int]) -> None:
        """Unmap the chunks at ``offsets`` (their files were retired) and let go of them."""
        assert self._chunks is not None
        for offset in offsets:
            self._chunks.unplace(offset)
            os.close(self._fds.pop(offset))

    def _retired(self, starts: np.ndarray, lengths: np.ndarray) -> list[int]:
        """Offsets of the mapped chunks from the one the ranges begin in to the one they
        end in (a few fcntl calls, whatever the number of ranges) whose file was retired."""
        offsets = sorted(self._fds)
        if not offsets or not len(starts):
            return []
        first = max(bisect.bisect_right(offsets, int(starts.min())) - 1, 0)
        last = bisect.bisect_right(offsets, int((starts + lengths).max()) - 1)
        return [offset for offset in offsets[first:last] if is_retired(self._fds[offset])]

    def _check_handed(self, reads: ReadBatch) -> None:
        if not self.holds(reads.src_offsets, reads.lengths):
            raise ForeignMemoryError("a range outside the arena chunks handed to this tenant")

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
        self._check_handed(reads)
        start = time.perf_counter()
        merged = merge_contiguous(reads)
        commands = copy_ranges(self._view, merged, dst)
        return TransferStats(merged.total_bytes, commands, time.perf_counter() - start, self.name)

    def close(self) -> None:
        # Dropping the view and the mapping object unmaps once no other view is alive;
        # mmap.close() would raise BufferError while a caller still holds a slice.
        self._view = None
        self._chunks = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
