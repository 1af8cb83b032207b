"""LMCache: its engine (``LMCacheEngine.store`` / ``retrieve`` / ``lookup``) over the local CPU
backend, and over the local disk backend alone, in one spawned process on CPU.

LMCache 0.5.6 moves KV between the serving engine's paged cache and its memory objects with a
*GPU connector*; the ones it ships assert a CUDA device (and create ``torch.cuda.Stream``s).
Its storage manager, backends, chunking, hashing and CPU memory allocator run on CPU as they
are (LMCache detects a CPU platform and uses its torch baseline ops). So the engine is given
:class:`HostPagesConnector`, a connector that does on host memory exactly the copy a GPU
connector does over PCIe: the session's pages into LMCache's memory objects (``store``) and
back (``retrieve``). A page is 16 tokens; a 256-token chunk (16 pages) is one memory object
of LMCache's ``[2, layers, tokens, hidden]`` fp16 shape (1 MiB for the default workload), whose
bytes hold the chunk's pages layer by layer (one strided copy per chunk, as a GPU connector's
gather is one kernel).

Put rate: ``store`` until ``lookup`` finds every token (the disk backend writes in the
background). Restore rate: ``retrieve`` of the first stored session into zeroed pages, byte
checked; for the disk backend its files are dropped from the page cache first. LMCache here
has no remote path (its remote backends need a separate server).
"""

from __future__ import annotations

import glob
import os
import time
from typing import Any

from benchmarks.peers.limits import answer, environment, spawn, stop
from benchmarks.peers.workload import (
    CONTROL_SAMPLES,
    TOKENS_PER_PAGE,
    Workload,
    check_bytes,
    gbps,
    median,
)

CHUNK_TOKENS = 256


def _connector_class() -> type:
    import torch
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class HostPagesConnector(GPUConnectorInterface):
        """LMCache's connector contract over host pages ``[layers, pages, page_bytes]``."""

        def __init__(self, layers: int, page_bytes: int) -> None:
            self.num_layers = layers
            self.half = page_bytes // 2 // TOKENS_PER_PAGE  # bytes per token of K (or V)
            self.kvcaches = None

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.num_layers, num_tokens, self.half // 2])  # fp16

        def _pair(self, memory_obj: Any, start: int, end: int, pages: Any) -> tuple[Any, Any]:
            n = (end - start) // TOKENS_PER_PAGE
            first = start // TOKENS_PER_PAGE
            host = pages[:, first : first + n].view(
                self.num_layers, n, 2, TOKENS_PER_PAGE, self.half
            )
            host = host.permute(2, 0, 1, 3, 4)  # [2, layers, pages, tokens, bytes]
            obj = memory_obj.tensor.view(torch.uint8).view(
                2, self.num_layers, n, TOKENS_PER_PAGE, self.half
            )
            return host, obj

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            host, obj = self._pair(memory_obj, start, end, kwargs["kvcaches"])
            obj.copy_(host)

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            host, obj = self._pair(memory_obj, start, end, kwargs["kvcaches"])
            host.copy_(obj)

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(memory_obj, start, end, **kwargs)

        def batched_to_gpu(
            self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kwargs: Any
        ) -> None:
            for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(memory_obj, start, end, **kwargs)

    return HostPagesConnector


def _engine(workload: Workload, backend: str, disk_dir: str) -> Any:
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    gib = round((workload.rounds + 2) * workload.nbytes / (1 << 30) + 0.25, 2)  # every round
    options = {
        "chunk_size": CHUNK_TOKENS,
        "lmcache_instance_id": f"peers-{backend}",
        "save_unfull_chunk": True,  # else the session's last, partial chunk is never stored
    }
    if backend == "cpu":
        options.update(local_cpu=True, max_local_cpu_size=gib)
    else:  # the disk backend alone: the CPU backend only allocates, caches nothing
        options.update(
            local_cpu=False,
            max_local_cpu_size=2,
            local_disk=disk_dir + "/",
            max_local_disk_size=gib,
        )
    config = LMCacheEngineConfig.from_defaults(**options)
    hidden = workload.page_bytes // 2 // TOKENS_PER_PAGE // 2
    metadata = LMCacheMetadata(
        model_name="peers-bench", world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.float16,
        kv_shape=(workload.layers, 2, CHUNK_TOKENS, 1, hidden),
    )  # fmt: skip
    connector = _connector_class()(workload.layers, workload.page_bytes)
    engine = LMCacheEngineBuilder.get_or_create(
        f"peers-{backend}", config, metadata, connector, None, None
    )
    engine.post_init()
    return engine


def _drop_cache(directory: str) -> None:
    for path in glob.glob(os.path.join(directory, "**", "*"), recursive=True):
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _measure(workload: Workload, backend: str, disk_dir: str) -> dict[str, Any]:
    import torch

    engine = _engine(workload, backend, disk_dir)
    tokens_n = workload.pages * TOKENS_PER_PAGE

    def tokens(round_: int) -> Any:  # a different prompt each round (stores are deduplicated)
        return (torch.arange(tokens_n) + round_ * 7919) % 50000

    puts = []
    for r in range(workload.rounds + 1):
        pages = torch.from_numpy(workload.kv(1000 + r))
        started = time.perf_counter()
        engine.store(tokens(r), kvcaches=pages)
        deadline = time.monotonic() + 600
        while engine.lookup(tokens(r)) < tokens_n:  # the disk backend writes in the background
            if time.monotonic() > deadline:
                raise TimeoutError(f"LMCache {backend}: stored tokens not found after 600 s")
            time.sleep(0.01)
        if r:
            puts.append(time.perf_counter() - started)
    expected = workload.kv(1000)
    out = torch.zeros(tuple(expected.shape), dtype=torch.uint8)
    restores = []
    for r in range(workload.rounds + 1):
        out.zero_()
        if backend == "disk":
            _drop_cache(disk_dir)
        started = time.perf_counter()
        found = engine.retrieve(tokens(0), kvcaches=out)
        seconds = time.perf_counter() - started
        if int(found.sum()) != tokens_n:
            raise RuntimeError(
                f"LMCache {backend} retrieved {int(found.sum())} of {tokens_n} tokens"
            )
        check_bytes(out.numpy(), expected, f"LMCache {backend}")
        if r:
            restores.append(seconds)
    lookups = []
    for _ in range(CONTROL_SAMPLES):
        started = time.perf_counter()
        engine.lookup(tokens(0))
        lookups.append((time.perf_counter() - started) * 1e3)
    return {
        "put": {"gbps": gbps(workload.nbytes, median(puts))},
        "restore": {"gbps": gbps(workload.nbytes, median(restores))},
        "lookup_ms": median(lookups),
    }


def _main(conn: Any, workload: Workload, backend: str, disk_dir: str) -> None:
    try:
        conn.send(_measure(workload, backend, disk_dir))
    except Exception as exc:
        conn.send(exc)
    finally:
        conn.close()
        os._exit(0)  # LMCache leaves non-daemon threads running; nothing else is left to do


def run_lmcache(workload: Workload, root: str) -> dict[str, Any]:
    """The CPU backend and the disk backend, each in a fresh process."""
    results = {}
    for backend, path in (("cpu", "local DRAM"), ("disk", "local SSD")):
        disk_dir = os.path.join(root, f"lmcache-{backend}")
        os.makedirs(disk_dir, exist_ok=True)
        with environment(LMCACHE_LOG_LEVEL="WARNING", PYTHONHASHSEED="0"):
            process, conn = spawn(_main, workload, backend, disk_dir)
        try:
            results[path] = answer(conn, timeout_s=1200)
        finally:
            stop(process, conn)
    return results
