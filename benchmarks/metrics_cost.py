"""What recording metrics costs a request: per call, and on a real small restore, in one run.

.venv/bin/python benchmarks/metrics_cost.py [--ray]

1. Per call: ``Metrics.restore_ended`` for a restore that read DRAM and SSD (two parts, two
   paths) and ``probed``: what the request's thread pays (a queue append) and what folding
   them into series costs later, per request; ``put_committed`` (inline, once per put).
   Without ``--ray`` only the in-process series move; with ``--ray`` (a local Ray is
   started) each fold also queues its batch for the forwarder thread, which hands it to
   ``ray.util.metrics`` once a second.
2. On the hot path: restore GB/s of ``FlatCakeStore.get`` (the in-process store records a
   restore's metrics at its release, as a Ray client does) of 4 DRAM pages (the cheapest
   restore there is, where a fixed per-request cost shows most), 64 DRAM and 64 SSD pages,
   request metrics on and off (``count_requests``), runs interleaved, the median of each.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatcake_ray.config import StoreConfig
from flatcake_ray.core.api import PutResult
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.gva import Medium
from flatcake_ray.metrics import record
from flatcake_ray.metrics.record import Metrics
from flatcake_ray.node.store import FlatCakeStore
from flatcake_ray.restore.source import PathTally, ReadOutcome

LAYERS, PAGE_BYTES = 4, 8192


def a_restore(store: FlatCakeStore) -> tuple[tuple, ReadOutcome]:
    """Real lease parts of a DRAM+SSD prefix, and an outcome shaped like a real one."""
    kv = np.zeros((LAYERS, 8, PAGE_BYTES), dtype=np.uint8)
    keys = [f"k{i}" for i in range(8)]
    store.put(keys[:4], kv[:, :4], session_id="s", hints=PutHints(turn=1))
    store.put(keys, kv, session_id="s", hints=PutHints(turn=2, prior_reply_tokens=1))
    lease = store.lease(keys)
    parts = store.source.lease(keys, None).parts
    store.release(lease)
    outcome = ReadOutcome(8, requested=8, seconds=0.001, queued_s=0.0001)
    outcome.paths = {
        "local-dram": PathTally(4, 4, 4 * LAYERS * PAGE_BYTES, 0, 0.0),
        "local-ssd": PathTally(4, 4, 4 * LAYERS * PAGE_BYTES, 4, 0.001),
    }
    outcome.bytes_read = {Medium.SSD: 4 * LAYERS * PAGE_BYTES}
    outcome.bytes_wanted = {m: 4 * LAYERS * PAGE_BYTES for m in Medium}
    outcome.commands = {Medium.SSD: 4}
    return parts, outcome


def per_call(store: FlatCakeStore, repeats: int, calls: int) -> None:
    """On the request's path: queueing a restore or probe (folding held off). Off it: the
    fold of ``calls`` queued requests, per request. Inline: a put commit."""
    parts, outcome = a_restore(store)
    result = PutResult(8, 0, Medium.SSD, "one-shot", "s")
    queued = {
        "restore_ended": lambda m: m.restore_ended(parts, outcome, 8, "bench"),
        "probed": lambda m: m.probed("bench", 8, 8),
    }
    folding = record.FOLD_EVERY
    record.FOLD_EVERY = calls + 1
    try:
        for label, call in queued.items():
            queue_us, fold_us = [], []
            for _ in range(repeats):
                metrics = Metrics(node_id=1, page_tokens=256)
                one = functools.partial(call, metrics)
                queue_us.append(timeit.timeit(one, number=calls) / calls * 1e6)
                fold_us.append(timeit.timeit(metrics.fold, number=1) / calls * 1e6)
            print(
                f"{label}: {statistics.median(queue_us):.2f} us/call on the request's path, "
                f"{statistics.median(fold_us):.1f} us/call folded later (median of {repeats})"
            )
    finally:
        record.FOLD_EVERY = folding
    metrics = Metrics(node_id=1, page_tokens=256)
    commit = lambda: metrics.put_committed("bench", LAYERS * PAGE_BYTES, result, "shm")  # noqa: E731
    times = [timeit.timeit(commit, number=calls) / calls * 1e6 for _ in range(repeats)]
    print(f"put_committed: {statistics.median(times):.1f} us/call (median of {repeats})")


def hot_path(store: FlatCakeStore, repeats: int, budget_s: float) -> None:
    """Restore GB/s with request metrics on and off, interleaved, per case (medium, pages)."""
    for medium, pages in ((Medium.DRAM, 4), (Medium.DRAM, 64), (Medium.SSD, 64)):
        kv = np.ones((LAYERS, pages, PAGE_BYTES), dtype=np.uint8)
        keys = [f"hot-{medium.name}-{pages}-{i}" for i in range(pages)]
        hints = PutHints(turn=2, prior_reply_tokens=1) if medium is Medium.DRAM else PutHints()
        assert store.put(keys, kv, session_id=keys[0], hints=hints).medium is medium
        out = np.zeros_like(kv)
        gets = _gets_within(store, keys, out, budget_s)
        rates: dict[bool, list[float]] = {True: [], False: []}
        for repeat in range(repeats):
            order = (True, False) if repeat % 2 == 0 else (False, True)  # neither always first
            for on in order:
                store.metrics.count_requests = on
                started = time.perf_counter()
                for _ in range(gets):
                    assert store.get(keys, out) == pages
                rates[on].append(gets * kv.nbytes / (time.perf_counter() - started) / 1e9)
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        paired = statistics.median(a / b for a, b in zip(rates[True], rates[False], strict=True))
        print(
            f"restore {pages} {medium.name} pages ({kv.nbytes >> 10} KiB): "
            f"{on:.3f} GB/s with request metrics, {off:.3f} GB/s without; on/off "
            f"{paired:.3f} (median of {repeats} paired runs of {gets} gets, adjacent in time)"
        )
    store.metrics.count_requests = True


def _gets_within(store: FlatCakeStore, keys: list[str], out: np.ndarray, budget_s: float) -> int:
    """How many gets take about ``budget_s`` (at least 3), timed after a warm-up get."""
    store.get(keys, out)
    started = time.perf_counter()
    store.get(keys, out)
    return max(3, int(budget_s / max(time.perf_counter() - started, 1e-6)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ray", action="store_true", help="forward to a local Ray too")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--run-s", type=float, default=0.3, help="seconds per timed run")
    args = parser.parse_args()
    if args.ray:
        import ray

        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as root:
        config = StoreConfig(
            root=root,
            layers=LAYERS,
            page_bytes=PAGE_BYTES,
            dram_bytes=32 << 20,
            ssd_file_bytes=32 << 20,
            fsync=False,
        )
        with FlatCakeStore(config) as store:
            per_call(store, args.repeats, 20_000)
            hot_path(store, args.repeats, args.run_s)


if __name__ == "__main__":
    main()
