"""Remote SSD: another node's pool pages, by NVMe-oF where its pool is visible here, else
shipped by the owner over NIXL.

- ``remote-ssd-nvmeof`` (:class:`NvmeofSsdTransport`): the owner's pool is exported (NVMe-oF
  namespace, or any block/file view) and visible on this node under a configured path,
  ``nvmeof_root`` with ``{node_id}`` filled in, holding the owner's pool file names. It is
  read exactly like local SSD (coalesced O_DIRECT), with no CPU of the owner involved.
  :func:`visible_pool` decides per owner whether that path holds the full pool.
- ``remote-ssd-shipped`` (:class:`ShippedSsdTransport`): the owner reads the ranges from its
  SSD into a region of its NIXL-registered ship buffer (one ``ship`` call per window of at
  most a quarter of that buffer), this node fetches the region with one NIXL READ, and frees
  it with a fire-and-forget ``unship``. The next window's ship is requested before this one
  is fetched, so the owner's SSD read overlaps the transfer. ``actor_calls`` counts the calls.
  It ``reads_ahead``: a restore announces all its windows at once in one streaming call
  (``transports/shipped_stream.py``), and the owner reads ahead of the fetches.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from flatcake_ray.config import ALIGN
from flatcake_ray.core.runs import align_down
from flatcake_ray.errors import (
    PeerDisconnectedError,
    ShipBufferFullError,
    TransferError,
    TransferTimeoutError,
    TransportClosedError,
)
from flatcake_ray.transports.base import (
    REMOTE_SSD_NVMEOF,
    REMOTE_SSD_SHIPPED,
    ReadBatch,
    ReadStream,
    TransferStats,
    Transport,
)
from flatcake_ray.transports.local_dram import merge_contiguous
from flatcake_ray.transports.local_ssd import LocalSsdTransport

log = logging.getLogger(__name__)


def visible_pool(
    nvmeof_root: str, node_id: int, pool_paths: tuple[str, ...], file_bytes: int
) -> tuple[list[str] | None, str | None]:
    """(paths, None) when the owner's whole pool is visible under ``nvmeof_root``, else
    (None, why not)."""
    if not nvmeof_root:
        return None, "no nvmeof_root configured"
    folder = Path(nvmeof_root.format(node_id=node_id))
    paths = [str(folder / Path(p).name) for p in pool_paths]
    for path in paths:
        if not os.path.exists(path):
            return None, f"{path} is not visible on this node"
        if os.path.getsize(path) < file_bytes:
            return None, f"{path} is smaller than a pool file ({file_bytes} bytes)"
    return paths, None


def _cut(reads: ReadBatch, limit: int) -> ReadBatch:
    if not len(reads) or int(reads.lengths.max()) <= limit:
        return reads
    pieces = -(-reads.lengths // limit)
    owner = np.repeat(np.arange(len(reads)), pieces)
    step = np.arange(len(owner)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    skip = step * limit
    lengths = np.minimum(limit, reads.lengths[owner] - skip)
    return ReadBatch(reads.src_offsets[owner] + skip, lengths, reads.dst_offsets[owner] + skip)


class NvmeofSsdTransport(LocalSsdTransport):
    """The owner's pool files as exported to this node, read with the local-SSD code."""

    name = REMOTE_SSD_NVMEOF

    @classmethod
    def probe(cls) -> str | None:
        # Per owner, see visible_pool(); the kernel side needs nvme-tcp or nvme-rdma.
        if not os.path.exists("/sys/module/nvme_fabrics"):
            return "no NVMe-oF in this kernel (nvme_fabrics not loaded)"
        return None


class ShippedSsdTransport(Transport):
    """The owner reads its SSD and ships over NIXL; source offsets are pool offsets."""

    name = REMOTE_SSD_SHIPPED
    reads_ahead: ClassVar[bool] = True

    def __init__(
        self, node: Any, ship_reader: Any, ship_bytes: int, pool_bytes: int, timeout_s: float
    ) -> None:
        self._node = node  # the owner's StorageNode actor handle
        self._reader = ship_reader  # a NixlDramTransport on the owner's ship buffer
        # Two windows in flight per reader (one being read, one crossing NIXL), and room for
        # a second reader doing the same.
        self._window = align_down(max(ALIGN, ship_bytes // 4))
        self._pool_bytes = pool_bytes
        self.timeout_s = timeout_s
        self.actor_calls = 0

    @property
    def broken(self) -> bool:
        """True once the NIXL reader inside failed: the caller builds a new transport."""
        return self._reader is not None and self._reader.broken

    @classmethod
    def probe(cls) -> str | None:
        from flatcake_ray.transports.nixl_dram import NixlDramTransport

        return NixlDramTransport.probe()

    def open_stream(self, batches: list[ReadBatch], lock: threading.Lock) -> ReadStream:
        from flatcake_ray.transports.shipped_stream import ShipStream

        if self._reader is None:
            raise TransportClosedError("remote-ssd-shipped transport is closed")
        for batch in batches:
            batch.check_source(self._pool_bytes, "the owner's SSD pool")
        return ShipStream(self, batches, lock)

    def call(self, method: str, *args: Any) -> Any:
        """A call to the owner (counted): its ObjectRef, or a stream's generator of them."""
        self.actor_calls += 1
        return getattr(self._node, method).remote(*args)

    def read(self, reads: ReadBatch, dst: np.ndarray) -> TransferStats:
        if self._reader is None:
            raise TransportClosedError("remote-ssd-shipped transport is closed")
        reads.check_destination(dst)
        reads.check_source(self._pool_bytes, "the owner's SSD pool")
        start = time.perf_counter()
        windows = self.windows(reads.nonempty())
        commands = 0
        pending = self._ship(windows[0]) if windows else None
        try:
            for i, window in enumerate(windows):
                assert pending is not None  # one ship per window, requested one ahead
                reply = self._wait(pending)
                # The owner reads the next window from its SSD while this one crosses NIXL.
                pending = self._ship(windows[i + 1]) if i + 1 < len(windows) else None
                try:
                    commands += reply.io_commands + self.fetch(window, dst, reply.offset).commands
                finally:
                    self.unship(reply.region_id)
        finally:
            if pending is not None:
                self._abandon(pending)
        return TransferStats(reads.total_bytes, commands, time.perf_counter() - start, self.name)

    def windows(self, reads: ReadBatch) -> list[ReadBatch]:
        """Consecutive groups of at most one window of bytes; longer ranges are cut first
        (source and destination advance together), so even one long extent pipelines."""
        reads = _cut(reads, self._window)
        ends = np.cumsum(reads.lengths)
        window_of = (ends - reads.lengths) // self._window
        cuts = np.flatnonzero(np.diff(window_of)) + 1
        pieces = np.split(np.arange(len(reads)), cuts) if len(reads) else []
        return [
            ReadBatch(reads.src_offsets[p], reads.lengths[p], reads.dst_offsets[p])
            for p in pieces
            if p.size
        ]

    def _ship(self, window: ReadBatch) -> tuple[Any, ReadBatch, float]:
        self.actor_calls += 1
        ref = self._node.ship.remote(window.src_offsets, window.lengths)
        return ref, window, time.monotonic() + self.timeout_s

    def _wait(self, pending: tuple[Any, ReadBatch, float]) -> Any:
        """The owner's ShipReply; a full ship buffer (other readers) is waited out."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        ref, window, deadline = pending
        while True:
            try:
                return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ShipBufferFullError as exc:
                if time.monotonic() > deadline:
                    raise TransferTimeoutError(
                        f"the owner's ship buffer stayed full: {exc}"
                    ) from exc
                time.sleep(0.005)
                ref = self._ship(window)[0]
            except GetTimeoutError as exc:
                raise TransferTimeoutError(f"the owner did not ship in {self.timeout_s}s") from exc
            except RayActorError as exc:
                raise PeerDisconnectedError(f"the owner of the SSD pages is gone: {exc}") from exc

    def unship(self, region_id: int) -> None:
        self.actor_calls += 1
        self._node.unship.remote(region_id)  # fire and forget: frees the region

    def _abandon(self, pending: tuple[Any, ReadBatch, float]) -> None:
        """A read failed with a ship in flight: free its region once it lands (else the
        region would wait for its TTL)."""
        from ray.exceptions import RayError

        try:
            self.unship(self._wait(pending).region_id)
        except (RayError, TransferError) as exc:
            log.warning("could not free a shipped region after a failed read: %s", exc)

    def fetch(self, window: ReadBatch, dst: np.ndarray, region: int) -> TransferStats:
        # The region holds the window's ranges packed in order; each lands at its dst offset,
        # and ranges that continue each other in both places become one NIXL descriptor.
        packed = np.cumsum(window.lengths) - window.lengths
        batch = merge_contiguous(ReadBatch(region + packed, window.lengths, window.dst_offsets))
        return self._reader.read(batch, dst)

    def close(self) -> None:
        # The NIXL reader belongs to the client's per-node connection; it closes it.
        self._reader = None
