"""The client's data plane: turning a lease reply into transport reads, and staging puts.

A lease reply lists, per segment, where the wanted pages sit (medium, offset, layout, per-layer
checksums) and where they go in the request. From it:

- DRAM parts become one :class:`ReadBatch` of page runs straight into the caller's buffer
  (``[layers, pages, page_bytes]`` flattened): O(layers x segments) ranges, no staging copy.
- SSD parts become per-layer *extents* (a segment's pages of one layer, the unit a checksum
  covers), read in windows into a reusable staging buffer, checked, then scattered. A torn or
  stale extent fails its checksum and becomes a miss, never wrong bytes.

Puts are staged in a :class:`StagingBuffer`: shared memory (memfd) the owner maps when it is
on this node, exported over NIXL (and pulled by the owner) when it is not.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flatcake_ray.actors.protocol import SegmentPart
from flatcake_ray.config import ALIGN
from flatcake_ray.errors import InvalidKeyError
from flatcake_ray.node.reader import checksum
from flatcake_ray.transports.base import ReadBatch, TransferStats

DEFAULT_WINDOW_BYTES = 32 << 20


@dataclass
class PathTally:
    """What one data path moved for one request (or in total, in the client's stats)."""

    reads: int = 0
    pages: int = 0
    bytes: int = 0
    io_commands: int = 0
    seconds: float = 0.0

    def add(self, stats: TransferStats, pages: int) -> None:
        self.reads += 1
        self.pages += pages
        self.bytes += stats.bytes
        self.io_commands += stats.commands
        self.seconds += stats.seconds

    def merge(self, other: PathTally) -> None:
        self.reads += other.reads
        self.pages += other.pages
        self.bytes += other.bytes
        self.io_commands += other.io_commands
        self.seconds += other.seconds


@dataclass
class RestoreReport:
    """One ``get``: pages restored, which path served them, and what it cost."""

    requested: int
    pages: int = 0
    node_id: int | None = None  # the node whose lease served the request
    paths: dict[str, PathTally] = field(default_factory=dict)
    actor_calls: int = 0
    nodes_asked: int = 0
    control_seconds: float = 0.0  # lookups and leases
    data_seconds: float = 0.0  # transports
    lease_expired: bool = False
    failures: list[str] = field(default_factory=list)

    def tally(self, path: str) -> PathTally:
        return self.paths.setdefault(path, PathTally())


def page_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src starts, dst starts, lengths) of the runs where both sides advance by one."""
    if not len(src):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.append(starts, len(src)))
    return src[starts], dst[starts], lengths


def dram_batch(parts: list[SegmentPart], layers: int, out_pages: int) -> ReadBatch:
    """Page runs of DRAM parts, from the arena straight into the flattened output."""
    src, lengths, dst = [], [], []
    for part in parts:
        src_start, dst_start, run = page_runs(part.src_pages, part.dst_positions)
        for layer in range(layers):
            src.append(part.layer_offset(layer) + src_start * part.page_bytes)
            dst.append((layer * out_pages + dst_start) * part.page_bytes)
            lengths.append(run * part.page_bytes)
    if not src:
        return ReadBatch([], [], [])
    return ReadBatch(np.concatenate(src), np.concatenate(lengths), np.concatenate(dst))


@dataclass(frozen=True)
class Extent:
    part: int  # index into the parts list
    layer: int
    src: int
    length: int


def ssd_windows(parts: list[SegmentPart], layers: int, window_bytes: int) -> list[list[Extent]]:
    """Every (part, layer) extent, in pool-offset order, cut into windows of bounded bytes."""
    extents = [
        Extent(i, layer, part.layer_offset(layer), part.layer_bytes)
        for i, part in enumerate(parts)
        for layer in range(layers)
    ]
    extents.sort(key=lambda e: e.src)
    windows: list[list[Extent]] = []
    size = 0
    for extent in extents:
        if not windows or (size + extent.length > window_bytes and windows[-1]):
            windows.append([])
            size = 0
        windows[-1].append(extent)
        size += extent.length
    return windows


def deliver_window(
    window: list[Extent],
    parts: list[SegmentPart],
    staging: np.ndarray,
    out: np.ndarray,
    bad_parts: set[int],
) -> None:
    """Check each extent's checksum in ``staging`` (packed in window order) and scatter its
    wanted pages into ``out`` ([layers, pages, page_bytes] uint8); bad ones go to bad_parts."""
    at = 0
    for extent in window:
        data = staging[at : at + extent.length]
        at += extent.length
        part = parts[extent.part]
        if extent.part in bad_parts:
            continue
        if checksum(data) != int(part.checksums[extent.layer]):
            bad_parts.add(extent.part)
            continue
        pages = data.reshape(part.pages, part.page_bytes)
        src_start, dst_start, run = page_runs(part.src_pages, part.dst_positions)
        for s, d, n in zip(src_start.tolist(), dst_start.tolist(), run.tolist(), strict=True):
            out[extent.layer, d : d + n] = pages[s : s + n]


def window_batch(window: list[Extent]) -> ReadBatch:
    return ReadBatch.packed([e.src for e in window], [e.length for e in window])


def first_bad_position(parts: list[SegmentPart], bad: set[int], hits: int) -> int:
    """Pages from the first that are good: up to the lowest position of any bad part."""
    return min([hits, *(int(parts[i].dst_positions.min()) for i in bad)])


class SharedStaging:
    """Anonymous shared memory (memfd) that another process of this node can map by the path
    ``/proc/<pid>/fd/<fd>``. It has no name in /dev/shm, so nothing is left behind when the
    client dies: the memory goes with the last mapping."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        self.fd = os.memfd_create("flatcake-stage", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self._map: mmap.mmap | None = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED)
        except OSError:
            os.close(self.fd)
            raise
        self.view = np.frombuffer(self._map, dtype=np.uint8)
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.token = uuid.uuid4().hex  # fd numbers are reused; this names this buffer

    def close(self) -> None:
        # Views may still be alive (a NIXL registration cache); dropping ours unmaps once
        # the last one goes, as mmap.close() would raise BufferError while they exist.
        self.view = np.zeros(0, dtype=np.uint8)
        self._map = None
        os.close(self.fd)


class StagingBuffer:
    """A put's bytes on their way to the owner: shared memory the owner maps (same node) or
    pulls from over NIXL (other node). Grows by replacement, under a new token, so an owner
    never reads a stale mapping of a replaced buffer."""

    def __init__(self) -> None:
        self.shared: SharedStaging | None = None
        self.exporter: Any = None
        self._agent: Any = None

    def ensure(self, nbytes: int) -> SharedStaging:
        if self.shared is None or self.shared.nbytes < nbytes:
            self.close()
            self.shared = SharedStaging(nbytes)
        return self.shared

    def peer(self) -> Any:
        """The NIXL peer description of this buffer (exported on first use)."""
        if self.exporter is None:
            from flatcake_ray.actors.nixl_roles import exporter_agent
            from flatcake_ray.transports.nixl_dram import NixlArenaExporter, unique_agent_name

            self._agent = exporter_agent(unique_agent_name("fc-stage"))
            view = self.shared.view
            self.exporter = NixlArenaExporter(self._agent.name, view, agent=self._agent)
        return self.exporter.peer_info()

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
            self._agent.close()
            self._agent = None
        if self.shared is not None:
            self.shared.close()
            self.shared = None


class StagingPool:
    """Staging buffers, one per put in flight (one by default: puts of one client queue for
    it; each exported buffer is a NIXL agent and a registration)."""

    def __init__(self, count: int = 1) -> None:
        self._all = [StagingBuffer() for _ in range(count)]
        self._free: queue.SimpleQueue[StagingBuffer] = queue.SimpleQueue()
        for buffer in self._all:
            self._free.put(buffer)
        self._lock = threading.Lock()

    def acquire(self) -> StagingBuffer:
        return self._free.get()

    def release(self, buffer: StagingBuffer) -> None:
        self._free.put(buffer)

    def close(self) -> None:
        with self._lock:
            for buffer in self._all:
                buffer.close()


def check_key(key: Any) -> None:
    """The rules of ``keys.digest_keys`` without hashing: bytes, str or int, not empty."""
    if isinstance(key, bool) or not isinstance(key, bytes | bytearray | memoryview | str | int):
        if not isinstance(key, np.integer):
            raise InvalidKeyError(f"page keys are bytes, str or int, not {type(key).__name__}")
    elif not isinstance(key, int) and len(key) == 0:
        raise InvalidKeyError("a page key may not be empty")
