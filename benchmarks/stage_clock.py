"""Timing a restore's and a put's stages from outside: the code's own functions, wrapped for
a run (``StageClock``) and put back after; medians and fractions of the limit per path.
Used by ``benchmarks/stages.py``, ``stages_ray.py`` and ``gpu_restore.py --stages``."""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import import_module
from typing import Any

# (stage, module, attribute path): the functions each stage is, where the code has them. A
# name missing in a checkout (renamed, or not there yet) is skipped, so --before works across
# versions.
RESTORE_STAGES = (
    ("lease", "flatcake_ray.node.source", "NodeSource.lease"),
    ("lease", "flatcake_ray.client.source", "TransportSource.lease"),
    ("lease.digests", "flatcake_ray.node.store", "key_digests"),
    ("lease.digests", "flatcake_ray.client.source", "digests_of"),
    ("plan", "flatcake_ray.core.plan", "RestorePlan.__init__"),
    ("plan", "flatcake_ray.core.plan", "RestorePlan.chunks"),
    ("fill", "flatcake_ray.restore.window", "Job.fill"),
    ("checksums", "flatcake_ray.restore.deliver", "ChunkDelivery._check"),
    ("scatter", "flatcake_ray.restore.deliver", "ChunkDelivery._scatter_host"),
    ("scatter", "flatcake_ray.restore.deliver", "ChunkDelivery._scatter_device"),
    # A checked mapped chunk copied into consecutive host slots, each block hashed after its
    # copy (one pass: the scatter and the checksums of that chunk at once).
    ("scatter+checksums", "flatcake_ray.restore.deliver", "copy_and_check"),
    # A checked chunk bound for pages split in memory or apart (vLLM's K and V planes,
    # scattered slots): each block copied into its pieces and hashed in one pass; before,
    # copied into a private buffer with its hash (``checked copy``), then scattered.
    ("scatter+checksums", "flatcake_ray.restore.deliver", "copy_into_pieces"),
    ("checked copy", "flatcake_ray.restore.deliver", "copy_blocks_checked"),
    ("release", "flatcake_ray.node.source", "NodeSource.release"),
    ("release", "flatcake_ray.client.source", "TransportSource.release"),
)
# The GPU paths' own pieces, beside RESTORE_STAGES (``benchmarks/gpu_restore.py --stages``):
# the scatter stage there is the host-to-device copy (cudaMemcpyAsync from the pinned arena or
# slot) plus the kernel, up to the stream's synchronize.
GPU_STAGES = (
    ("fill.odirect", "flatcake_ray.transports.local_ssd", "LocalSsdTransport.read"),
    ("fill.gds", "flatcake_ray.transports.local_ssd", "GdsSsdTransport.read"),
    ("checksums.source", "flatcake_ray.restore.deliver", "ChunkDelivery._source_bytes"),
    ("scatter.kernel_launch", "flatcake_ray.cuda_ext._dispatch", "_launch"),
    ("scatter.cpu_copy", "flatcake_ray.cuda_ext._dispatch", "copy_on_host"),
)
PUT_STAGES = (
    ("open", "flatcake_ray.node.store", "FlatCakeStore.begin_put"),
    ("open", "flatcake_ray.client.put", "RemotePut._open"),
    ("copy", "flatcake_ray.node.put", "PutHandle.write_pages"),
    ("copy", "flatcake_ray.client.put", "RemotePut._place"),
    ("copy.into_medium", "flatcake_ray.node.writer", "SegmentWriter._place"),
    ("checksums", "flatcake_ray.node.writer", "layer_checksums"),
    ("checksums", "flatcake_ray.node.writer", "parallel_layer_checksums"),
    ("drive", "flatcake_ray.media.pool", "SsdPool.write"),
    ("drive", "flatcake_ray.media.pool", "SsdPool.sync"),
    ("land", "flatcake_ray.client.put", "RemotePut._land"),
    ("land", "flatcake_ray.client.put", "RemotePut._settle_oldest"),
    ("commit", "flatcake_ray.node.put", "PutHandle.commit"),
    ("commit", "flatcake_ray.client.put", "RemotePut.commit"),
)


class StageClock:
    """Wraps functions so each call's wall time adds to its stage (any thread); ``install``
    for a run, ``uninstall`` puts the originals back."""

    def __init__(self, stages=RESTORE_STAGES + PUT_STAGES) -> None:
        self._stages = stages
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = defaultdict(float)
        self._undo: list[tuple[Any, str, Any]] = []

    def install(self) -> StageClock:
        for stage, module_name, path in self._stages:
            try:
                owner: Any = import_module(module_name)
            except ImportError:
                continue
            *parents, name = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent, None)
            original = None if owner is None else owner.__dict__.get(name)
            if original is None or isinstance(original, staticmethod | classmethod):
                continue
            setattr(owner, name, self._timed(stage, original))
            self._undo.append((owner, name, original))
        return self

    def uninstall(self) -> None:
        while self._undo:
            owner, name, original = self._undo.pop()
            setattr(owner, name, original)

    def _timed(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        seconds, lock = self._seconds, self._lock

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                with lock:
                    seconds[stage] += spent

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    @contextmanager
    def op(self, into: list[dict[str, float]]) -> Iterator[None]:
        """Time one operation: its stages (ms) and its wall time go to ``into``."""
        with self._lock:
            self._seconds.clear()
        start = time.perf_counter()
        yield
        wall = time.perf_counter() - start
        with self._lock:
            row = {stage: s * 1e3 for stage, s in self._seconds.items()}
        row["wall"] = wall * 1e3
        into.append(row)


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per stage, the median over operations (a stage absent from an operation counts 0)."""
    names = sorted({name for row in rows for name in row})
    return {name: round(statistics.median([r.get(name, 0.0) for r in rows]), 2) for name in names}


def summarise(nbytes: int, rows: list[dict[str, float]], limits: list[float]) -> dict[str, Any]:
    stages = medians(rows)
    gbps = nbytes / (stages["wall"] / 1e3) / 1e9
    limit = statistics.median(limits)
    return {
        "gbps": round(gbps, 3),
        "limit_gbps": round(limit, 3),
        "fraction": round(gbps / limit, 3),
        "stages_ms": stages,
    }
