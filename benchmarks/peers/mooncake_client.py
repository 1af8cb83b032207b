"""One Mooncake store client, in a process of its own (spawned by ``sys_mooncake.py``).

It registers its page buffers once and answers the commands its parent sends over a pipe:
zero-copy puts and gets of one object per page (the layers are the object's slices), the
control-path calls alone, disk-replica counts, and clearing DRAM replicas.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from benchmarks.peers.workload import PreparedBytes, Workload, check_bytes, wait_until


class StoreClient:
    """Runs in the spawned process: a MooncakeDistributedStore and two registered buffers."""

    def __init__(self, spec: dict[str, Any], workload: Workload) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.workload, self.name = workload, spec["local_hostname"]
        self.store = MooncakeDistributedStore()
        if spec.get("ssd_offload_path"):
            os.makedirs(spec["ssd_offload_path"], exist_ok=True)
        if self.store.setup(spec) != 0:
            raise RuntimeError(f"Mooncake client {self.name} failed to set up")
        shape = (workload.layers, spec["pages"], workload.page_bytes)
        self.src, self.out = np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)
        self._bytes = PreparedBytes(workload)
        for array in (self.src, self.out):
            if self.store.register_buffer(array.ctypes.data, array.nbytes) != 0:
                raise RuntimeError("Mooncake register_buffer failed")

    def _slices(self, array: np.ndarray, pages: int) -> tuple[list[list[int]], list[list[int]]]:
        base, stride = array.ctypes.data, array.shape[1] * array.shape[2]
        size = self.workload.page_bytes
        ptrs = [
            [base + layer * stride + p * size for layer in range(self.workload.layers)]
            for p in range(pages)
        ]
        return ptrs, [[size] * self.workload.layers for _ in range(pages)]

    def prepare(self, session: str, pages: int, seed: int) -> None:
        """Make ``session``'s bytes before a concurrent round (``workload.PreparedBytes``)."""
        self._bytes.make(session, pages, seed)

    def put(
        self, session: str, pages: int, seed: int, segment: str, start_at: float | None = None
    ) -> dict[str, Any]:
        from mooncake.store import ReplicateConfig

        self.src[:, :pages] = self._bytes.take(session, pages, seed)
        ptrs, sizes = self._slices(self.src, pages)
        config = ReplicateConfig()
        config.preferred_segment = segment
        keys = self.workload.keys(session, pages)
        wait_until(start_at)
        started = time.time()
        codes = self.store.batch_put_from_multi_buffers(keys, ptrs, sizes, config)
        ended = time.time()
        failed = [c for c in codes if c != 0]
        if failed:
            raise RuntimeError(
                f"Mooncake put of {session}: {len(failed)} keys failed ({failed[0]})"
            )
        return {"start": started, "end": ended, "bytes": pages * self.workload.object_bytes}

    def get(
        self,
        session: str,
        pages: int,
        seed: int,
        start_at: float | None = None,
        check: bool = True,
    ) -> dict[str, Any]:
        """One get, checked byte for byte (``check`` off: by ``check``, once the round's
        concurrent gets are over)."""
        ptrs, sizes = self._slices(self.out, pages)
        self.out[:, :pages] = 0
        keys = self.workload.keys(session, pages)
        wait_until(start_at)
        started = time.time()
        got = self.store.batch_get_into_multi_buffers(keys, ptrs, sizes)
        ended = time.time()
        short = [g for g in got if g != self.workload.object_bytes]
        if short:
            raise RuntimeError(f"Mooncake get of {session}: {len(short)} keys failed ({short[0]})")
        if check:
            self.check(session, pages, seed)
        return {"start": started, "end": ended, "bytes": pages * self.workload.object_bytes}

    def check(self, session: str, pages: int, seed: int) -> None:
        """The last get of ``pages`` pages holds ``session``'s bytes, byte for byte."""
        expected = self._bytes.of(session, pages, seed)
        check_bytes(self.out[:, :pages], expected, f"Mooncake {session}")

    def control(self, session: str, pages: int) -> dict[str, float]:
        """``batch_is_exist`` and ``batch_get_replica_desc`` (the lease) for the same keys."""
        keys = self.workload.keys(session, pages)
        start = time.perf_counter()
        exist = self.store.batch_is_exist(keys)
        mid = time.perf_counter()
        replicas = self.store.batch_get_replica_desc(keys)
        end = time.perf_counter()
        if sum(e == 1 for e in exist) != pages or len(replicas) != pages:
            raise RuntimeError(f"Mooncake control: keys of {session} missing")
        return {"exist_ms": (mid - start) * 1e3, "lease_ms": (end - mid) * 1e3}

    def on_disk(self, session: str, pages: int) -> dict[str, int]:
        """How many keys have a disk replica and how many still a DRAM one."""
        replicas = self.store.batch_get_replica_desc(self.workload.keys(session, pages))
        disk = sum(
            any(r.is_local_disk_replica() or r.is_disk_replica() for r in rs)
            for rs in replicas.values()
        )
        dram = sum(any(r.is_memory_replica() for r in rs) for rs in replicas.values())
        return {"disk": disk, "dram": dram}

    def clear_dram(self, session: str, pages: int, segment: str) -> int:
        return len(self.store.batch_replica_clear(self.workload.keys(session, pages), segment))

    def close(self) -> None:
        self.store.close()


def client_main(conn: Any, spec: dict[str, Any], workload: Workload) -> None:
    try:
        client = StoreClient(spec, workload)
        conn.send("ready")
    except Exception as exc:
        conn.send(exc)
        return
    while True:
        command, args = conn.recv()
        if command == "stop":
            client.close()
            conn.send("stopped")
            return
        try:
            conn.send(getattr(client, command)(*args))
        except Exception as exc:
            conn.send(exc)
