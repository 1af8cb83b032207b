"""Where a client gathers a layer's new pages before one NIXL WRITE to a remote owner.

A :class:`StagingArena` hands out regions of a few large segments of anonymous memory
(memfd), each registered with NIXL on first use (and cached). A put holds a region only for
the WRITE of one layer; the arena grows by a segment only when every segment is full of
regions in flight, so its memory follows the puts in flight, not context lengths. Nothing is
left behind when the client dies: memfd memory goes with the last mapping.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

from flatcake_ray.config import ALIGN
from flatcake_ray.core.extents import ExtentAllocator
from flatcake_ray.core.runs import align_up


class SharedSegment:
    """Anonymous shared memory (memfd) that another process of this node can map."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = align_up(max(ALIGN, nbytes))
        self.fd = os.memfd_create("flatcake-stage", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self._map: mmap.mmap | None = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED)
        except OSError:
            os.close(self.fd)
            raise
        self.view = np.frombuffer(self._map, dtype=np.uint8)
        self.allocator = ExtentAllocator(0, self.nbytes)

    def close(self) -> None:
        # Views may still be alive (a NIXL registration cache); dropping ours unmaps once
        # the last one goes, as mmap.close() would raise BufferError while they exist.
        self.view = np.zeros(0, dtype=np.uint8)
        self._map = None
        os.close(self.fd)


@dataclass(frozen=True)
class Region:
    segment: SharedSegment
    offset: int
    nbytes: int

    @property
    def view(self) -> np.ndarray:
        return self.segment.view[self.offset : self.offset + self.nbytes]


class StagingArena:
    """Regions of staging segments, first fit; a new segment when none has room."""

    def __init__(self, segment_bytes: int, max_segments: int = 64) -> None:
        self.segment_bytes = segment_bytes
        self.max_segments = max_segments
        self.segments: list[SharedSegment] = []
        self._lock = threading.Condition()

    @property
    def nbytes(self) -> int:
        return sum(segment.nbytes for segment in self.segments)

    def take(self, nbytes: int, timeout: float | None = None) -> Region:
        """A region of at least ``nbytes``; waits for one to be given back when the arena is
        at its segment limit (``TimeoutError`` after ``timeout``)."""
        want = align_up(max(nbytes, 1))
        found: list[Region] = []

        def fits() -> bool:
            region = self._fit(want)
            if region is not None:
                found.append(region)
            return region is not None

        with self._lock:
            if not self._lock.wait_for(fits, timeout):
                raise TimeoutError(f"no {want}-byte staging region freed in {timeout} s")
        return found[0]

    def _fit(self, want: int) -> Region | None:
        for segment in self.segments:
            start = segment.allocator.allocate(want)
            if start is not None:
                return Region(segment, start, want)
        if len(self.segments) >= self.max_segments:
            return None
        segment = SharedSegment(max(want, self.segment_bytes))
        self.segments.append(segment)
        start = segment.allocator.allocate(want)
        assert start is not None
        return Region(segment, start, want)

    def give(self, region: Region) -> None:
        with self._lock:
            region.segment.allocator.free(region.offset, region.nbytes)
            self._lock.notify_all()

    def close(self) -> None:
        with self._lock:
            for segment in self.segments:
                segment.close()
            self.segments.clear()
