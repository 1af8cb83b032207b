"""Local SSD: O_DIRECT reads of a node's SSD pool files, exactly as planned.

Reads arrive already coalesced and aligned by the restore plan (``flatcake_ray/core/plan.py``:
coalescing is planned once, there); this transport executes each range as one command. A
range that starts, ends or lands unaligned is read through an aligned bounce buffer (other
callers: the object-store fallback's owner side). The storage node's own restores, a client
on the owner's node (which opens the pool read-only, :meth:`SsdPool.open_readonly`) and the
owner filling its ship buffer for readers elsewhere all read through this class. It holds no
state between calls, so several threads may read through one instance at once.

:class:`GdsSsdTransport` reads the same files straight into GPU memory through kvikio
(GPUDirect Storage). :func:`gds_reader` applies the ``gds`` setting: ``off``; ``auto`` (GDS
where kvikio loads and cuFile is not in compat mode, O_DIRECT otherwise, logged once); ``on``
(GDS or a :class:`~flatcake_ray.errors.TransportUnavailableError`).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np

from flatcake_ray.config import ALIGN
from flatcake_ray.core.runs import align_down, align_up
from flatcake_ray.errors import (
    ReadRangeError,
    TransferError,
    TransportClosedError,
    TransportUnavailableError,
)
from flatcake_ray.media.buffers import AlignedBuffer
from flatcake_ray.media.pool import SsdPool
from flatcake_ray.transports.base import (
    LOCAL_SSD,
    LOCAL_SSD_GDS,
    ReadBatch,
    TransferStats,
    Transport,
)

log = logging.getLogger(__name__)
_said: set[str] = set()
# Commands in flight per read: a drive streams at its rate only with several outstanding
# (sequential O_DIRECT at depth 1 leaves it idle between commands).
READ_DEPTH = 4
PIECE_BYTES = 4 << 20
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def split_at_files(batch: ReadBatch, file_bytes: int) -> ReadBatch:
    """The same ranges, cut where one would cross from one pool file into the next."""
    batch = batch.nonempty()
    first = batch.src_offsets // file_bytes
    last = (batch.src_offsets + batch.lengths - 1) // file_bytes
    if (first == last).all():
        return batch
    src, lengths, dst = [], [], []
    for s, n, d in zip(
        batch.src_offsets.tolist(), batch.lengths.tolist(), batch.dst_offsets.tolist(), strict=True
    ):
        while n:
            piece = min(n, file_bytes - s % file_bytes)
            src.append(s)
            lengths.append(piece)
            dst.append(d)
            s, n, d = s + piece, n - piece, d + piece
    return ReadBatch(src, lengths, dst)


def depth_pieces(batch: ReadBatch) -> list[tuple[int, int, int]]:
    """``(src, length, dst)`` commands: each range cut into pieces of about ``PIECE_BYTES``
    (aligned, so a piece of an aligned range stays aligned), so that a read of a whole slot
    keeps ``READ_DEPTH`` commands in flight instead of one."""
    commands = []
    for s, n, d in zip(
        batch.src_offsets.tolist(), batch.lengths.tolist(), batch.dst_offsets.tolist(), strict=True
    ):
        step = n if n < 2 * PIECE_BYTES else PIECE_BYTES
        for at in range(0, n, step):
            commands.append((s + at, min(step, n - at), d + at))
    return commands


def _readers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(READ_DEPTH, thread_name_prefix="flatcake-ssd-read")
        return _pool


class LocalSsdTransport(Transport):
    """Reads ranges of an SSD pool: source offsets are pool offsets (the GVA's Offset)."""

    name = LOCAL_SSD

    def __init__(self, pool: SsdPool, *, owns_pool: bool = False) -> None:
        self._pool: SsdPool | None = pool
        self._owns_pool = owns_pool

    @classmethod
    def open(cls, paths: list[str] | tuple[str, ...], file_bytes: int) -> LocalSsdTransport:
        """Open a pool this process does not own, read-only."""
        return cls(SsdPool.open_readonly(paths, file_bytes), owns_pool=True)

    @classmethod
    def probe(cls) -> str | None:
        return None  # plain files: always usable (O_DIRECT falls back to buffered, logged)

    @property
    def pool(self) -> SsdPool:
        if self._pool is None:
            raise TransportClosedError(f"{self.name} transport is closed")
        return self._pool

    def read(self, reads: ReadBatch, dst: np.ndarray) -> TransferStats:
        pool = self.pool
        reads.check_destination(dst)
        reads.check_source(pool.file_bytes * len(pool.paths), f"the SSD pool {pool.paths[:1]}")
        start = time.perf_counter()
        reads = split_at_files(reads, pool.file_bytes)
        commands = depth_pieces(reads)
        if len(commands) == 1 or READ_DEPTH == 1:
            for s, n, d in commands:
                self._read_one(pool, s, n, dst, d)
        else:  # READ_DEPTH commands in flight: preadv releases the GIL while the drive works
            futures = [
                _readers().submit(self._read_one, pool, s, n, dst, d) for s, n, d in commands
            ]
            for future in futures:
                future.result()  # every command is waited for before an error is raised
        return TransferStats(
            reads.total_bytes, len(commands), time.perf_counter() - start, self.name
        )

    @staticmethod
    def _read_one(pool: SsdPool, src: int, length: int, dst: np.ndarray, at: int) -> None:
        file_index, offset = pool.locate(src)
        aligned = not (offset % ALIGN or length % ALIGN or (dst.ctypes.data + at) % ALIGN)
        try:
            if aligned:
                pool.read_into(file_index, offset, dst[at : at + length])
                return
            lo = align_down(offset)
            bounce = AlignedBuffer(align_up(offset + length) - lo)
            try:
                pool.read_into(file_index, lo, bounce.array)
                dst[at : at + length] = bounce.array[offset - lo : offset - lo + length]
            finally:
                bounce.close()
        except OSError as exc:
            raise TransferError(f"reading {pool.paths[file_index]}: {exc}") from exc

    def close(self) -> None:
        if self._pool is not None and self._owns_pool:
            self._pool.close()
        self._pool = None


class GdsSsdTransport(Transport):
    """GPUDirect Storage through kvikio: pool ranges straight into a CUDA buffer.

    ``dst`` is a 1-D uint8 CUDA tensor (the restore pipeline's device slot); each range is one
    ``cuFileRead`` at its offset. Ranges come aligned from the restore plan.
    """

    name = LOCAL_SSD_GDS
    destination: ClassVar[str] = "device"

    def __init__(self, paths: list[str] | tuple[str, ...], file_bytes: int) -> None:
        import kvikio

        self.file_bytes = file_bytes
        self._files: list[Any] = [kvikio.CuFile(path, "r") for path in paths]

    @classmethod
    def probe(cls) -> str | None:
        if importlib.util.find_spec("kvikio") is None:
            return "kvikio not installed (pip install '.[gpu]')"
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
        import kvikio.defaults

        if kvikio.defaults.compat_mode():
            return "cuFile unavailable (kvikio would run in POSIX compat mode)"
        return None

    def read(self, reads: ReadBatch, dst: Any) -> TransferStats:
        if not self._files:
            raise TransportClosedError(f"{self.name} transport is closed")
        if len(reads) and int((reads.dst_offsets + reads.lengths).max()) > dst.numel():
            raise ReadRangeError("a range ends past the device buffer")
        reads.check_source(self.file_bytes * len(self._files), "the SSD pool")
        start = time.perf_counter()
        reads = split_at_files(reads, self.file_bytes)
        futures = []
        for s, n, d in zip(
            reads.src_offsets.tolist(),
            reads.lengths.tolist(),
            reads.dst_offsets.tolist(),
            strict=True,
        ):
            file_index, offset = divmod(s, self.file_bytes)
            futures.append(self._files[file_index].pread(dst[d : d + n], n, offset))
        try:
            for future in futures:
                future.get()
        except RuntimeError as exc:
            raise TransferError(f"cuFile read failed: {exc}") from exc
        return TransferStats(reads.total_bytes, len(reads), time.perf_counter() - start, self.name)

    def close(self) -> None:
        for handle in self._files:
            handle.close()
        self._files = []


def gds_wanted(mode: str) -> bool:
    """Whether SSD reads go through GPUDirect Storage under the ``gds`` setting ("auto":
    where it works; "on" where it does not: :class:`TransportUnavailableError`)."""
    if mode == "off":
        return False
    reason = GdsSsdTransport.probe()
    if reason is None:
        return True
    if mode == "on":
        raise TransportUnavailableError(f"gds=on but GPUDirect Storage is unavailable: {reason}")
    if "gds" not in _said:
        _said.add("gds")
        log.info("GPUDirect Storage off (%s); SSD reads use O_DIRECT into host memory", reason)
    return False


def gds_reader(mode: str, paths: list[str] | tuple[str, ...], file_bytes: int):
    """The GDS transport the ``gds`` setting asks for, or None (O_DIRECT into host slots)."""
    return GdsSsdTransport(paths, file_bytes) if gds_wanted(mode) else None
