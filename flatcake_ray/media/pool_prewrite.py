"""Writing an SSD pool's never-written space once, in the background (``ssd_prewrite``).

``posix_fallocate`` gives a pool file its blocks as "unwritten" extents: the file system
converts them as they are first written, a journal transaction per write command, and a first
O_DIRECT write into such space ran at 0.55-0.59 of a write into space written once before
(``benchmarks/odirect_fresh_space.py``). A pool reaches written space only after wrapping
around once. The prewriter writes zeros over the unwritten ranges (found with ``SEEK_HOLE``,
which ext4 and XFS report for unwritten extents; a file system without unwritten extents
reports none) so every later put overwrites written blocks.

Never over data: :meth:`PoolPrewrite.claim` runs before every data write (``SsdPool.write``)
and marks its range, under the lock the prewriter holds while it writes a step of zeros; a
step skips every claimed range, and a claim that comes while a step is writing waits for it,
so the data lands after the zeros. Reads only ever cover data ranges, so they never see the
zeros. A store reopened before it finished finds the rest with ``SEEK_HOLE`` again.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Sequence

from flatcake_ray.errors import ConfigError
from flatcake_ray.failpoints import failpoint
from flatcake_ray.media.log import log_once

log = logging.getLogger("flatcake_ray.media")

STEP = 8 << 20  # zeros written per lock hold: a claim waits at most one such write
ALIGN = 4096


def unwritten_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of ``fd`` that hold no data (holes and unwritten extents)."""
    ranges: list[tuple[int, int]] = []
    at = 0
    while at < size:
        try:
            hole = os.lseek(fd, at, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            # A file system that cannot say where its holes are: nothing known to prewrite.
            log_once("seek-hole", "SSD pool: SEEK_HOLE refused (%s); no prewrite", exc)
            return []
        if hole >= size:
            break
        try:
            data = os.lseek(fd, hole, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no data after the hole
                raise
            data = size
        ranges.append((hole, min(data, size)))
        at = data
    return ranges


def _minus(start: int, end: int, claimed: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[start, end)`` no claimed range covers."""
    pieces = [(start, end)]
    for lo, hi in claimed:
        pieces = [
            part
            for a, b in pieces
            for part in ((a, min(b, lo)), (max(a, hi), b))
            if part[0] < part[1]
        ]
    return pieces


class PoolPrewrite:
    """One background thread writing zeros over a pool's unwritten ranges, file by file."""

    def __init__(self, fds: Sequence[int], file_bytes: int, step: int = STEP) -> None:
        if step <= 0 or step % ALIGN:
            raise ConfigError(f"prewrite step must be a positive multiple of {ALIGN}", "step")
        self._fds, self._step = list(fds), step
        self._todo = [
            (index, start, end)
            for index, fd in enumerate(self._fds)
            for start, end in unwritten_ranges(fd, file_bytes)
        ]
        self.pending_bytes = sum(end - start for _, start, end in self._todo)
        self.error: OSError | None = None  # why it stopped early (the pool stays correct)
        self._claimed: dict[int, list[tuple[int, int]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._done = not self._todo
        self._thread: threading.Thread | None = None
        if self._todo:
            self._thread = threading.Thread(
                target=self._run, name="flatcake-ssd-prewrite", daemon=True
            )
            self._thread.start()

    @property
    def done(self) -> bool:
        return self._done

    def claim(self, file_index: int, start: int, end: int) -> None:
        """Mark ``[start, end)`` of a file as data before it is written (never zeroed after)."""
        if self._done:
            return
        with self._lock:
            if not self._done:
                self._claimed.setdefault(file_index, []).append((start, end))

    def _run(self) -> None:
        zeros = mmap.mmap(-1, self._step)  # page-aligned and zero: what O_DIRECT writes from
        try:
            for index, start, end in self._todo:
                for at in range(start, end, self._step):
                    if self._stop.is_set():
                        return
                    self._write_step(index, at, min(end, at + self._step), zeros)
        except OSError as exc:
            self.error = exc
            log.warning("SSD pool prewrite stopped (%s); first writes stay slower", exc)
        finally:
            zeros.close()
            with self._lock:
                self._done = True
                self._claimed.clear()

    def _write_step(self, index: int, start: int, end: int, zeros: mmap.mmap) -> None:
        with self._lock:
            failpoint("pool.prewrite", offset=start)
            for lo, hi in _minus(start, end, self._claimed.get(index, ())):
                view = memoryview(zeros)[: hi - lo]
                while view.nbytes:
                    written = os.pwrite(self._fds[index], view, lo)
                    view, lo = view[written:], lo + written
            self.pending_bytes -= end - start

    def close(self) -> None:
        """Stop after the step in flight (the rest is found again at the next open)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
