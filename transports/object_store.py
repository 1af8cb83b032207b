"""LAST RESORT: remote pages through the Ray object store.

Used only where neither NIXL nor RDMA (nor an NVMe-oF view) can reach the owner, and always
reported as ``object-store-fallback`` in the read stats, so a deployment that silently runs
on it is visible. The owner copies the ranges into a reply array (one actor call per read),
Ray carries it through its object store, and this side copies it into the destination.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import PeerDisconnectedError, TransferTimeoutError, TransportClosedError
from flatcake_ray.transports.base import OBJECT_STORE_FALLBACK, ReadBatch, TransferStats, Transport
from flatcake_ray.transports.local_dram import merge_contiguous


class ObjectStoreTransport(Transport):
    """Ranges of one owner's medium: source offsets are that medium's offsets."""

    name = OBJECT_STORE_FALLBACK

    def __init__(self, node: Any, medium: Medium, source_bytes: int, timeout_s: float) -> None:
        self._node: Any = node  # the owner's StorageNode actor handle
        self._medium = Medium(medium)
        self._source_bytes = source_bytes
        self._timeout_s = timeout_s
        self.actor_calls = 0

    @classmethod
    def probe(cls) -> str | None:
        import ray

        return None if ray.is_initialized() else "not connected to a Ray cluster"

    def read(self, reads: ReadBatch, dst: np.ndarray) -> TransferStats:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self._node is None:
            raise TransportClosedError("object-store-fallback transport is closed")
        reads.check_destination(dst)
        reads.check_source(self._source_bytes, f"the owner's {self._medium.name}")
        reads = merge_contiguous(reads)
        start = time.perf_counter()
        if not len(reads):
            return TransferStats(0, 0, 0.0, self.name)
        self.actor_calls += 1
        ref = self._node.read_ranges.remote(int(self._medium), reads.src_offsets, reads.lengths)
        try:
            packed = ray.get(ref, timeout=self._timeout_s)
        except GetTimeoutError as exc:
            raise TransferTimeoutError(f"the owner did not answer in {self._timeout_s}s") from exc
        except RayActorError as exc:
            raise PeerDisconnectedError(f"the owner is gone: {exc}") from exc
        at = 0
        for n, d in zip(reads.lengths.tolist(), reads.dst_offsets.tolist(), strict=True):
            dst[d : d + n] = packed[at : at + n]
            at += n
        return TransferStats(reads.total_bytes, len(reads), time.perf_counter() - start, self.name)

    def close(self) -> None:
        self._node = None
