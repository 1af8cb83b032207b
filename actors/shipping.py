"""The owner's side of shipped SSD reads, and the region allocator the landing area shares.

- :class:`ShipBuffer` ("remote-ssd-shipped"): a reader on another node, with no NVMe-oF view
  of this node's pool, asks for SSD ranges; the node reads them (coalesced O_DIRECT, the
  local-SSD transport's code) into a region of a NIXL-registered bounce buffer, and the
  reader fetches the region with one NIXL READ, then frees it. Regions expire after a TTL,
  so a reader that died does not hold the buffer.
- :meth:`ShipBuffer.stream`: the same for a whole restore in one call (a Ray streaming
  generator): the node reads window after window into free regions and yields each region
  as soon as it is filled, so its SSD reads run ahead of the reader's fetches, bounded by
  the buffer (a full buffer waits for the reader's ``unship``, until a deadline).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from flatcake_ray.core.runs import align_up
from flatcake_ray.errors import ReadRangeError, ShipBufferFullError, TransferTimeoutError
from flatcake_ray.media.buffers import AlignedBuffer
from flatcake_ray.media.pool import SsdPool
from flatcake_ray.transports.base import ReadBatch
from flatcake_ray.transports.local_ssd import LocalSsdTransport

log = logging.getLogger(__name__)
# Windows a stream reads at once. One at a time left the drive idle between a read's end and
# the next one's start (a 16 MiB window took 6-12 ms in a node beside a reader's NIXL READs
# and checked copies; 5.4 ms alone); three were slower than two (BENCHMARKS.md, "Issue 22,
# 6 Dec night").
STREAM_AHEAD = 2
_FULL = object()  # no free region now, and windows read ahead are pending


@dataclass(frozen=True)
class ShipReply:
    region_id: int
    offset: int  # of the packed ranges in the ship buffer
    nbytes: int
    io_commands: int  # O_DIRECT reads the node made


class RegionAllocator:
    """First-fit regions of a fixed buffer, each freed explicitly or when its TTL runs out."""

    def __init__(self, nbytes: int, ttl_s: float) -> None:
        self.nbytes = nbytes
        self.ttl_s = ttl_s
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (start, length)
        self._held: dict[int, tuple[int, int, float, str]] = {}

    def allocate(self, nbytes: int, owner: str = "") -> tuple[int, int]:
        """(region id, start) of a region only ``owner`` may free (ids are random 63-bit
        numbers, so nobody else can name it); ShipBufferFullError when nothing fits."""
        nbytes = align_up(nbytes)
        found = self._first_fit(nbytes)
        if found is None:
            self._expire(time.monotonic())
            found = self._first_fit(nbytes)
        if found is None:
            raise ShipBufferFullError(f"no {nbytes} free bytes in the {self.nbytes}-byte buffer")
        region_id = secrets.randbits(63)
        self._held[region_id] = (found, nbytes, time.monotonic() + self.ttl_s, owner)
        return region_id, found

    def _first_fit(self, nbytes: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= nbytes:
                rest = (start + nbytes, length - nbytes)
                self._free[i : i + 1] = [rest] if rest[1] else []
                return start
        return None

    def free(self, region_id: object, owner: str = "") -> bool:
        """Give back ``owner``'s region; False (nothing changes) for anyone else's."""
        held = self._held.get(region_id) if isinstance(region_id, int) else None
        if held is None or held[3] != owner or not isinstance(region_id, int):
            return False
        del self._held[region_id]
        self._give_back(held[0], held[1])
        return True

    def _give_back(self, start: int, length: int) -> None:
        merged = sorted([*self._free, (start, length)])
        out: list[tuple[int, int]] = []
        for s, n in merged:
            if out and out[-1][0] + out[-1][1] == s:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((s, n))
        self._free = out

    def _expire(self, now: float) -> None:
        for region_id, held in list(self._held.items()):
            if held[2] < now:
                self.free(region_id, held[3])

    @property
    def held(self) -> int:
        return len(self._held)


class ShipBuffer:
    def __init__(self, nbytes: int, pool: SsdPool, *, ttl_s: float) -> None:
        self.buffer = AlignedBuffer(nbytes)
        self.regions = RegionAllocator(self.buffer.nbytes, ttl_s)
        self.reader = LocalSsdTransport(pool)
        self.exporter: Any = None  # a NixlArenaExporter of ``buffer`` once exported
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # a region went back: a stream may go on
        self._readers = ThreadPoolExecutor(STREAM_AHEAD, thread_name_prefix="flatcake-ship")
        self._running: set[tuple[str, int]] = set()  # (owner, stream id) of live streams
        self._stopped: set[tuple[str, int]] = set()  # live streams their readers gave up
        self.counters = {
            **{"ships": 0, "shipped_bytes": 0, "ship_io_commands": 0},
            **{"ship_streams": 0, "ship_stream_waits": 0},
        }

    def export(self, agent: Any) -> Any:
        """Register the buffer on the node's exporter agent; returns its NixlPeerInfo."""
        from flatcake_ray.transports.nixl_dram import NixlArenaExporter

        self.exporter = NixlArenaExporter(agent.name, self.buffer.array, agent=agent)
        return self.exporter.peer_info()

    def ship(self, src_offsets: np.ndarray, lengths: np.ndarray, owner: str = "") -> ShipReply:
        total = self._fits(lengths)
        with self._lock:
            region_id, start = self.regions.allocate(total, owner)
        return self._fill(region_id, start, src_offsets, lengths, owner)

    def _fits(self, lengths: np.ndarray) -> int:
        total = int(np.asarray(lengths, dtype=np.int64).sum())
        if total > self.buffer.nbytes:
            raise ReadRangeError(f"{total} bytes asked, the ship buffer holds {self.buffer.nbytes}")
        return total

    def _fill(
        self, region_id: int, start: int, src_offsets: np.ndarray, lengths: np.ndarray, owner: str
    ) -> ShipReply:
        """Read the ranges into the region, which only this caller holds (no lock needed for
        the read); frees it on failure."""
        try:
            stats = self.reader.read(
                ReadBatch.packed(src_offsets, lengths, start), self.buffer.array
            )
        except BaseException:
            self.unship(region_id, owner)
            raise
        total = int(np.asarray(lengths).sum())
        with self._lock:
            self.counters["ships"] += 1
            self.counters["shipped_bytes"] += total
            self.counters["ship_io_commands"] += stats.commands
        return ShipReply(region_id, start, total, stats.commands)

    def stream(
        self,
        windows: list[tuple[np.ndarray, np.ndarray]],
        owner: str,
        stream_id: int,
        deadline_s: float,
        check: Callable[[np.ndarray, np.ndarray], None],
    ) -> Iterator[ShipReply]:
        """Each window's ranges read into a region, yielded in order as it is filled, with up
        to ``STREAM_AHEAD`` windows read at once; ``check`` (the lease check) runs right
        before each read. A window waits for a free region at most ``deadline_s``
        (TransferTimeoutError); :meth:`stop` ends the stream early."""
        key = (owner, stream_id)
        with self._lock:
            if key in self._running:
                raise ReadRangeError(f"stream {stream_id} is already running")
            self._running.add(key)
            self.counters["ship_streams"] += 1
        reading: deque[Future[ShipReply]] = deque()  # windows read ahead, in order
        try:
            for src_offsets, lengths in windows:
                total = self._fits(lengths)
                found = self._region_for(total, owner, key, deadline_s, reading)
                while found is _FULL:  # a window read ahead holds the room: hand it over first
                    yield reading.popleft().result()
                    found = self._region_for(total, owner, key, deadline_s, reading)
                if found is None:
                    return  # the reader stopped the stream
                assert isinstance(found, tuple)
                try:
                    started = self._read_ahead(found, src_offsets, lengths, owner, check)
                except BaseException:
                    while reading:  # the windows checked before this one still go to the reader
                        yield reading.popleft().result()
                    raise
                reading.append(started)
                if len(reading) >= STREAM_AHEAD:
                    yield reading.popleft().result()
            while reading:
                yield reading.popleft().result()
        finally:
            self._drop_unyielded(reading, owner)
            with self._lock:
                self._running.discard(key)
                self._stopped.discard(key)

    def _region_for(
        self,
        nbytes: int,
        owner: str,
        key: tuple[str, int],
        deadline_s: float,
        reading: deque[Future[ShipReply]],
    ) -> tuple[int, int] | object | None:
        """A free region for a stream's next window; ``_FULL`` when none is free and windows
        read ahead are pending (they go to the reader first: waiting here for the reader to
        free a region would wait on ourselves); None once the stream is stopped."""
        with self._lock:
            if not reading:
                return self._wait_for_region(nbytes, owner, key, time.monotonic() + deadline_s)
            if key in self._stopped:
                return None
            try:
                return self.regions.allocate(nbytes, owner)
            except ShipBufferFullError:
                return _FULL

    def _read_ahead(
        self,
        found: tuple[int, int],
        src_offsets: np.ndarray,
        lengths: np.ndarray,
        owner: str,
        check: Callable[[np.ndarray, np.ndarray], None],
    ) -> Future[ShipReply]:
        """The window's lease checked now (a failed check frees its region and raises), its
        read started on the stream's readers."""
        try:
            check(src_offsets, lengths)
        except BaseException:
            self.unship(found[0], owner)
            raise
        return self._readers.submit(self._fill, *found, src_offsets, lengths, owner)

    def _drop_unyielded(self, reading: deque[Future[ShipReply]], owner: str) -> None:
        """Windows read ahead that the reader will never get: their regions go back."""
        for future in reading:
            try:
                reply = future.result()
            except Exception as exc:  # a failed read freed its own region
                log.info("a window read ahead for a stream that ended failed: %s", exc)
                continue
            self.unship(reply.region_id, owner)
        reading.clear()

    def _wait_for_region(
        self, nbytes: int, owner: str, key: tuple[str, int], deadline: float
    ) -> tuple[int, int] | None:
        """A region for a stream (caller holds the lock), or None once the stream is stopped."""
        while key not in self._stopped:
            try:
                return self.regions.allocate(nbytes, owner)
            except ShipBufferFullError as exc:
                self.counters["ship_stream_waits"] += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(f"the ship buffer stayed full: {exc}") from exc
                self._freed.wait(min(left, 0.05))  # TTL expiry frees without a notify
        return None

    def stop(self, owner: str, stream_id: int) -> None:
        """The reader of ``stream_id`` gave up: the stream yields nothing more (the regions
        it already yielded are the reader's to unship)."""
        with self._lock:
            if (owner, stream_id) in self._running:
                self._stopped.add((owner, stream_id))
                self._freed.notify_all()

    def unship(self, region_id: object, owner: str = "") -> bool:
        with self._lock:
            freed = self.regions.free(region_id, owner)
            self._freed.notify_all()
            return freed

    def read_ssd(self, src_offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The object-store fallback: ranges packed into a fresh array (no NIXL)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        out = np.empty(int(lengths.sum()), dtype=np.uint8)
        with self._lock:
            self.reader.read(ReadBatch.packed(src_offsets, lengths), out)
        return out

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        self._readers.shutdown(wait=True)
        self.reader.close()
