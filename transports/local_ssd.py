"""Local SSD: coalesced O_DIRECT reads of this node's SSD pool files.

A client on the owner's node opens the pool files read-only with O_DIRECT
(:meth:`SsdPool.open_readonly`) and reads them itself; the storage node uses the same class
to fill its ship buffer for readers on other nodes (``remote-ssd-shipped``). Ranges are
sort-merged by :func:`flatcake_ray.coalesce.coalesce` (holes under ``gap_bytes`` bridged,
4 KiB aligned, at most ``max_read_bytes`` a command), so a restore is O(layers) large reads.
Reads run in a background thread one command ahead of the copy-out (double buffering).

Where CUDA and cuFile exist, :class:`GdsSsdTransport` reads the same files straight into GPU
memory through kvikio (GPUDirect Storage); it is imported lazily and skipped here.
"""

from __future__ import annotations

import importlib.util
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from flatcake_ray.config import ALIGN
from flatcake_ray.core.coalesce import CoalescedReads, coalesce
from flatcake_ray.errors import ReadRangeError, TransferError, TransportClosedError
from flatcake_ray.media.buffers import AlignedBuffer
from flatcake_ray.media.pool import SsdPool
from flatcake_ray.transports.base import LOCAL_SSD, ReadBatch, TransferStats, Transport

DEFAULT_GAP_BYTES = 64 << 10
DEFAULT_MAX_READ_BYTES = 32 << 20


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


class LocalSsdTransport(Transport):
    """Reads ranges of an SSD pool: source offsets are pool offsets (the GVA's Offset)."""

    name = LOCAL_SSD

    def __init__(
        self,
        pool: SsdPool,
        *,
        gap_bytes: int = DEFAULT_GAP_BYTES,
        max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
        owns_pool: bool = False,
    ) -> None:
        self._pool: SsdPool | None = pool
        self._owns_pool = owns_pool
        self.gap_bytes = gap_bytes
        self.max_read_bytes = max_read_bytes
        self._buffers = [AlignedBuffer(max_read_bytes), AlignedBuffer(max_read_bytes)]
        self.device_bytes = 0
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-io")

    @classmethod
    def open(cls, paths: list[str] | tuple[str, ...], file_bytes: int, **options: Any):
        """Open a pool this process does not own, read-only."""
        return cls(SsdPool.open_readonly(paths, file_bytes), owns_pool=True, **options)

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
        if not len(reads):
            return TransferStats(0, 0, 0.0, self.name)
        files, offsets = np.divmod(reads.src_offsets, pool.file_bytes)
        merged = coalesce(
            files,
            offsets,
            reads.lengths,
            gap_bytes=self.gap_bytes,
            max_read_bytes=self.max_read_bytes,
            align=ALIGN,
        )
        self._run(merged, reads, dst)
        self.device_bytes += merged.bytes  # with alignment and bridged gaps
        elapsed = time.perf_counter() - start
        return TransferStats(reads.total_bytes, merged.count, elapsed, self.name)

    def _run(self, merged: CoalescedReads, reads: ReadBatch, dst: np.ndarray) -> None:
        order = np.argsort(merged.descriptor_read, kind="stable")
        bounds = np.searchsorted(merged.descriptor_read[order], np.arange(merged.count + 1))
        groups = [order[bounds[r] : bounds[r + 1]] for r in range(merged.count)]
        targets = [self._direct_target(merged, reads, dst, r, g) for r, g in enumerate(groups)]
        pending = self._submit(merged, 0, targets)
        for r, group in enumerate(groups):
            view = pending.result()
            pending = self._submit(merged, r + 1, targets)
            if targets[r] is not None:
                continue  # the drive wrote straight into dst
            for d in group.tolist():
                skip, n, at = (
                    int(merged.descriptor_skip[d]),
                    int(reads.lengths[d]),
                    int(reads.dst_offsets[d]),
                )
                dst[at : at + n] = view[skip : skip + n]
        pending.result()

    @staticmethod
    def _direct_target(
        merged: CoalescedReads, reads: ReadBatch, dst: np.ndarray, r: int, group: np.ndarray
    ) -> np.ndarray | None:
        """The slice of ``dst`` that read ``r`` can land in as it is (no bounce copy): when
        its ranges tile it exactly, in the same order and spacing in dst, at an aligned
        address. Extents of a layer-major segment read into packed staging usually do."""
        length = int(merged.lengths[r])
        by_skip = group[np.argsort(merged.descriptor_skip[group], kind="stable")]
        skips, lengths = merged.descriptor_skip[by_skip], reads.lengths[by_skip]
        ends = skips + lengths
        tiles = skips[0] == 0 and (skips[1:] == ends[:-1]).all() and ends[-1] == length
        shift = reads.dst_offsets[by_skip] - skips
        if not tiles or (shift != shift[0]).any():
            return None
        start = int(shift[0])
        if (dst.ctypes.data + start) % ALIGN or start < 0 or start + length > dst.size:
            return None
        return dst[start : start + length]

    def _submit(self, merged: CoalescedReads, r: int, targets: list) -> Future:
        if r >= merged.count:
            done: Future = Future()
            done.set_result(None)
            return done
        length = int(merged.lengths[r])
        view = targets[r]
        if view is None:
            slot = r % 2
            if self._buffers[slot].nbytes < length:  # one range longer than max_read_bytes
                self._buffers[slot] = AlignedBuffer(length)
            view = self._buffers[slot].array[:length]
        file_index, offset = int(merged.files[r]), int(merged.offsets[r])

        def fill() -> np.ndarray:
            try:
                self.pool.read_into(file_index, offset, view)
            except OSError as exc:
                raise TransferError(f"reading {self.pool.paths[file_index]}: {exc}") from exc
            return view

        return self._io.submit(fill)

    def close(self) -> None:
        if self._pool is None:
            return
        self._io.shutdown(wait=True)
        if self._owns_pool:
            self._pool.close()
        self._pool = None
        self._buffers = []


class GdsSsdTransport:
    """GPUDirect Storage through kvikio: pool ranges straight into a CUDA buffer.

    Selected by the client when the destination is a CUDA tensor and :meth:`probe` passes;
    each coalesced read is one ``cuFileRead`` into a device staging buffer, then a device
    copy scatters the ranges. Not a :class:`Transport` (its destination is device memory).
    """

    name = "local-ssd-gds"

    def __init__(self, paths: list[str] | tuple[str, ...], file_bytes: int, gap_bytes: int):
        import kvikio

        self._kvikio = kvikio
        self.file_bytes = file_bytes
        self.gap_bytes = gap_bytes
        self._files = [kvikio.CuFile(path, "r") for path in paths]

    @classmethod
    def probe(cls) -> str | None:
        if importlib.util.find_spec("kvikio") is None:
            return "kvikio not installed"
        if importlib.util.find_spec("torch") is None:
            return "torch not installed"
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
        import kvikio.defaults

        if kvikio.defaults.compat_mode():
            return "cuFile unavailable (kvikio would run in POSIX compat mode)"
        return None

    def read_to_device(self, reads: ReadBatch, dst: Any) -> TransferStats:
        """``dst``: a 1-D uint8 CUDA tensor; ranges as in :meth:`Transport.read`."""
        import torch

        if len(reads) and int((reads.dst_offsets + reads.lengths).max()) > dst.numel():
            raise ReadRangeError("a range ends past the device buffer")
        start = time.perf_counter()
        reads = split_at_files(reads, self.file_bytes)
        files, offsets = np.divmod(reads.src_offsets, self.file_bytes)
        merged = coalesce(files, offsets, reads.lengths, gap_bytes=self.gap_bytes, align=ALIGN)
        staging = torch.empty(int(merged.lengths.max()), dtype=torch.uint8, device=dst.device)
        for r in range(merged.count):
            n = int(merged.lengths[r])
            self._files[int(merged.files[r])].pread(staging[:n], n, int(merged.offsets[r])).get()
            for d in np.flatnonzero(merged.descriptor_read == r).tolist():
                skip, length = int(merged.descriptor_skip[d]), int(reads.lengths[d])
                at = int(reads.dst_offsets[d])
                dst[at : at + length].copy_(staging[skip : skip + length], non_blocking=True)
        torch.cuda.current_stream(dst.device).synchronize()
        return TransferStats(merged.bytes, merged.count, time.perf_counter() - start, self.name)

    def close(self) -> None:
        for handle in self._files:
            handle.close()
        self._files = []
