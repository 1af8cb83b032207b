"""Writing an SSD pool's never-written space once, in the background (``ssd_prewrite``).

``posix_fallocate`` gives a pool file its blocks as "unwritten" extents: the file system
converts them as they are first written, a journal transaction per write command, and a first
O_DIRECT write into such space ran at 0.55-0.59 of a write into space written once before
(``benchmarks/odirect_fresh_space.py``). A pool reaches written space only after wrapping
around once. The prewriter writes zeros over the unwritten ranges (found with ``SEEK_HOLE``,
which ext4 and XFS report for unwritten extents; a file system without unwritten extents
reports none) so every later put overwrites written blocks: a thread per drive, so a pool of
several drives is written in the time of one. Each step waits while others use its drive
(``drive_activity.py``: a live restore or put, from any process), so the prewrite takes the
drive's idle time and a young node's live I/O runs as fast as on a written pool.

Never over data: :meth:`PoolPrewrite.claim` runs before every data write (``SsdPool.write``)
and marks its range, under the lock the drive's prewriter holds while it writes a step of zeros; a
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
import time
from collections.abc import Callable, Sequence

from flatcake_ray.config import ALIGN
from flatcake_ray.errors import ConfigError
from flatcake_ray.failpoints import failpoint
from flatcake_ray.media.drive_activity import DriveActivity
from flatcake_ray.media.log import log_once

log = logging.getLogger("flatcake_ray.media")

STEP = 8 << 20  # zeros written per lock hold: a claim waits at most one such write
IDLE_POLL_S = 0.02  # how often a waiting prewriter looks at its drive again
# The longest a step waits for an idle drive: one that is never idle is still written, at
# a step a second.
MAX_PAUSE_S = 1.0


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


def pwrite_whole(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd`` (a write may take fewer bytes): the one
    loop a pool's data writes (``SsdPool.write``) and the prewrite's zeros both go through."""
    while data.nbytes:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


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


class _DrivePrewrite:
    """One drive's files (the pool's ``fds``, written only where ``todo`` names them): a thread
    writing their unwritten ranges, and the lock its steps and the data writes' claims share
    (a drive's own, so drives are written at once). Before each step it waits while others
    use the drive (``activity``; None: never waits), at most ``max_pause_s`` a step."""

    def __init__(
        self,
        fds: Sequence[int],
        todo: list[tuple[int, int, int]],
        step: int,
        stop: threading.Event,
        activity: DriveActivity | None,
        max_pause_s: float,
    ) -> None:
        self._fds, self._todo, self._step, self._stop = fds, todo, step, stop
        self._activity, self._max_pause_s = activity, max_pause_s
        self._own_bytes = 0  # written since the drive was last looked at
        self.paused_s = 0.0
        self.pending_bytes = sum(end - start for _, start, end in todo)
        self.error: OSError | None = None
        self._claimed: dict[int, list[tuple[int, int]]] = {}
        self._lock = threading.Lock()
        self.done = not todo
        self.thread = threading.Thread(target=self._run, name="flatcake-ssd-prewrite", daemon=True)
        if todo:
            self.thread.start()

    def claim(self, file_index: int, start: int, end: int) -> None:
        if self.done:
            return
        with self._lock:
            if not self.done:
                self._claimed.setdefault(file_index, []).append((start, end))

    def _run(self) -> None:
        zeros = mmap.mmap(-1, self._step)  # page-aligned and zero: what O_DIRECT writes from
        try:
            for index, start, end in self._todo:
                for at in range(start, end, self._step):
                    self._wait_for_idle_drive()
                    if self._stop.is_set():
                        return
                    self._write_step(index, at, min(end, at + self._step), zeros)
        except OSError as exc:
            self.error = exc
            log.warning("SSD pool prewrite stopped (%s); first writes stay slower", exc)
        finally:
            zeros.close()
            with self._lock:
                self.done = True
                self._claimed.clear()

    def _wait_for_idle_drive(self) -> None:
        """Wait while others read or write the drive (a live restore or put: the prewrite
        takes the drive's idle time, not theirs), rechecking every ``IDLE_POLL_S``; at most
        ``max_pause_s``, so a drive that is never idle is still written, a step at a time."""
        if self._activity is None:
            return
        own, self._own_bytes = self._own_bytes, 0
        started = time.monotonic()
        while self._activity.others_since(own):
            own = 0
            waited = time.monotonic() - started
            if waited >= self._max_pause_s or self._stop.wait(IDLE_POLL_S):
                break
        self.paused_s += time.monotonic() - started

    def _write_step(self, index: int, start: int, end: int, zeros: mmap.mmap) -> None:
        with self._lock:
            failpoint("pool.prewrite", offset=start)
            for lo, hi in _minus(start, end, self._claimed.get(index, ())):
                pwrite_whole(self._fds[index], memoryview(zeros)[: hi - lo], lo)
                self._own_bytes += hi - lo
            self.pending_bytes -= end - start


class PoolPrewrite:
    """A pool's unwritten ranges written once: a thread per drive (file ``i`` of the pool is
    on drive ``i % drives``, as :class:`~flatcake_ray.media.pool.SsdPool` lays them out)."""

    def __init__(
        self,
        fds: Sequence[int],
        file_bytes: int,
        step: int = STEP,
        drives: int = 1,
        *,
        activity: Callable[[int], DriveActivity | None] | None = DriveActivity.of,
        max_pause_s: float = MAX_PAUSE_S,
    ) -> None:
        """``activity``: how a drive's use by others is seen, given its first file's
        descriptor (None, or None for a drive: the prewrite never waits for it)."""
        if step <= 0 or step % ALIGN:
            raise ConfigError(f"prewrite step must be a positive multiple of {ALIGN}", "step")
        self._drives = max(1, min(drives, len(fds)))
        self._stop = threading.Event()
        todo = [
            (index, start, end)
            for index, fd in enumerate(fds)
            for start, end in unwritten_ranges(fd, file_bytes)
        ]
        self._parts = [
            _DrivePrewrite(
                fds,
                [t for t in todo if t[0] % self._drives == drive],
                step,
                self._stop,
                None if activity is None else activity(fds[drive]),
                max_pause_s,
            )
            for drive in range(self._drives)
        ]

    @property
    def done(self) -> bool:
        return all(part.done for part in self._parts)

    @property
    def pending_bytes(self) -> int:
        return sum(part.pending_bytes for part in self._parts)

    @property
    def paused_seconds(self) -> float:
        """Seconds the drives' prewriters waited for others to leave their drives idle."""
        return sum(part.paused_s for part in self._parts)

    @property
    def error(self) -> OSError | None:
        """Why a drive's prewrite stopped early (the pool stays correct), the first found."""
        return next((part.error for part in self._parts if part.error is not None), None)

    def claim(self, file_index: int, start: int, end: int) -> None:
        """Mark ``[start, end)`` of a file as data before it is written (never zeroed after)."""
        self._parts[file_index % self._drives].claim(file_index, start, end)

    def close(self) -> None:
        """Stop after the steps in flight (the rest is found again at the next open)."""
        self._stop.set()
        for part in self._parts:
            if part.thread.is_alive():
                part.thread.join()
