"""The owner's side of two data paths that need its CPU: shipped SSD reads and pulled puts.

- :class:`ShipBuffer` ("remote-ssd-shipped"): a reader on another node, with no NVMe-oF view
  of this node's pool, asks for SSD ranges; the node reads them (coalesced O_DIRECT, the
  local-SSD transport's code) into a region of a NIXL-registered bounce buffer, and the
  reader fetches the region with one NIXL READ, then frees it. Regions expire after a TTL,
  so a reader that died does not hold the buffer.
- :class:`PullArea` (remote puts): a client stages a put in its own NIXL-registered buffer;
  the node READs it over NIXL into a reusable local buffer and writes it into the store.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from flatcake_ray.config import ALIGN
from flatcake_ray.core.runs import align_up
from flatcake_ray.errors import ReadRangeError, ShipBufferFullError, TransferError
from flatcake_ray.media.buffers import AlignedBuffer
from flatcake_ray.media.pool import SsdPool
from flatcake_ray.transports.base import ReadBatch
from flatcake_ray.transports.local_ssd import LocalSsdTransport


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
        if held is None or held[3] != owner:
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
        self.counters = {"ships": 0, "shipped_bytes": 0, "ship_io_commands": 0}

    def export(self, agent: Any) -> Any:
        """Register the buffer on the node's exporter agent; returns its NixlPeerInfo."""
        from flatcake_ray.transports.nixl_dram import NixlArenaExporter

        self.exporter = NixlArenaExporter(agent.name, self.buffer.array, agent=agent)
        return self.exporter.peer_info()

    def ship(self, src_offsets: np.ndarray, lengths: np.ndarray, owner: str = "") -> ShipReply:
        lengths = np.asarray(lengths, dtype=np.int64)
        total = int(lengths.sum())
        if total > self.buffer.nbytes:
            raise ReadRangeError(f"{total} bytes asked, the ship buffer holds {self.buffer.nbytes}")
        with self._lock:
            region_id, start = self.regions.allocate(total, owner)
            try:
                stats = self.reader.read(
                    ReadBatch.packed(src_offsets, lengths, start), self.buffer.array
                )
            except BaseException:
                self.regions.free(region_id, owner)
                raise
            self.counters["ships"] += 1
            self.counters["shipped_bytes"] += total
            self.counters["ship_io_commands"] += stats.commands
        return ShipReply(region_id, start, total, stats.commands)

    def unship(self, region_id: object, owner: str = "") -> bool:
        with self._lock:
            return self.regions.free(region_id, owner)

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
        self.reader.close()


class PullArea:
    """Reusable local buffers a node READs staged puts into, and one NIXL reader per peer."""

    def __init__(self, agent_name: str, slots: int = 2, max_peers: int = 8) -> None:
        from flatcake_ray.actors.nixl_roles import reader_agent

        self.agent = reader_agent(agent_name)
        self._slots: queue.SimpleQueue[AlignedBuffer] = queue.SimpleQueue()
        for _ in range(slots):
            self._slots.put(AlignedBuffer(ALIGN))
        self._peers: OrderedDict[str, tuple[Any, threading.Lock]] = OrderedDict()
        self._max_peers = max_peers
        self._lock = threading.Lock()

    def _reader(self, peer: Any) -> tuple[Any, threading.Lock]:
        """The cached reader of ``peer``; one that broke (a failed READ removed its peer) or
        that reaches an older export under the same name is closed and replaced."""
        with self._lock:
            known = self._peers.get(peer.agent_name)
            if known is not None:
                reader, lock = known
                if not reader.broken and reader.peer == peer:
                    self._peers.move_to_end(peer.agent_name)
                    return known
                del self._peers[peer.agent_name]
                with lock:  # after any read still using it
                    reader.close()
            known = (self._connect(peer), threading.Lock())
            self._peers[peer.agent_name] = known
            while len(self._peers) > self._max_peers:
                _, (old, old_lock) = self._peers.popitem(last=False)
                with old_lock:
                    old.close()
            return known

    def _connect(self, peer: Any) -> Any:
        from flatcake_ray.transports.nixl_dram import NixlDramTransport

        return NixlDramTransport(self.agent, peer)

    def pull(self, peer: Any, offset: int, nbytes: int) -> tuple[AlignedBuffer, np.ndarray]:
        """READ ``nbytes`` at ``offset`` of the peer's staging buffer; give the slot back with
        :meth:`done` once its bytes are in the store."""
        slot = self._slots.get()
        try:
            if slot.nbytes < nbytes:
                slot = AlignedBuffer(nbytes)  # the old one's registration ages out of the cache
            self._read(peer, ReadBatch([offset], [nbytes], [0]), slot.array)
        except BaseException:
            self._slots.put(slot)
            raise
        return slot, slot.array[:nbytes]

    def _read(self, peer: Any, batch: ReadBatch, dst: np.ndarray) -> None:
        for _ in range(3):
            known = self._reader(peer)
            reader, lock = known
            with lock:
                # Another pull may have broken or replaced this reader while we waited.
                if reader.broken or self._peers.get(peer.agent_name) is not known:
                    continue
                reader.read(batch, dst)
                return
        raise TransferError(f"no working NIXL reader of {peer.agent_name}")

    def done(self, slot: AlignedBuffer) -> None:
        self._slots.put(slot)

    def close(self) -> None:
        with self._lock:
            for reader, _ in self._peers.values():
                reader.close()
            self._peers.clear()
        self.agent.close()
