"""What recording metrics costs a request: per call, and on a real small restore, in one run.

.venv/bin/python benchmarks/metrics_cost.py [--ray]

1. Per call: ``Metrics.restore_ended`` for a restore that read DRAM and SSD (two parts, two
   paths), ``probed`` and ``put_committed``. Without ``--ray`` only the in-process series
   move; with ``--ray`` (a local Ray is started) each call also queues its batch for the
   forwarder thread, which hands it to ``ray.util.metrics`` once a second.
2. On the hot path: ``FlatCakeStore.get`` of 4 DRAM pages (the cheapest restore there is),
   request metrics on and off (``count_requests``), interleaved, the median of each.
"""

from __future__ import annotations

import argparse
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
    metrics = Metrics(node_id=1, page_tokens=256)
    parts, outcome = a_restore(store)
    result = PutResult(8, 0, Medium.SSD, "one-shot", "s")
    cases = {
        "restore_ended": lambda: metrics.restore_ended(parts, outcome, 8, "bench"),
        "probed": lambda: metrics.probed("bench", 8, 8),
        "put_committed": lambda: metrics.put_committed("bench", LAYERS * PAGE_BYTES, result, "shm"),
    }
    for label, call in cases.items():
        times = [timeit.timeit(call, number=calls) / calls * 1e6 for _ in range(repeats)]
        print(f"{label}: {statistics.median(times):.1f} us/call (median of {repeats})")


def hot_path(store: FlatCakeStore, repeats: int, gets: int) -> None:
    kv = np.ones((LAYERS, 4, PAGE_BYTES), dtype=np.uint8)
    keys = [f"hot{i}" for i in range(4)]
    store.put(keys, kv, session_id="hot", hints=PutHints(turn=2, prior_reply_tokens=1))
    out = np.zeros_like(kv)
    samples: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for on in (True, False):
            store.metrics.count_requests = on
            started = time.perf_counter()
            for _ in range(gets):
                store.get(keys, out)
            samples[on].append((time.perf_counter() - started) / gets * 1e6)
    on, off = statistics.median(samples[True]), statistics.median(samples[False])
    print(
        f"get of 4 DRAM pages: {on:.0f} us with request metrics, {off:.0f} us without "
        f"(ratio {on / off:.3f}; median of {repeats} interleaved runs of {gets})"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ray", action="store_true", help="forward to a local Ray too")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.ray:
        import ray

        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as root:
        config = StoreConfig(
            root=root,
            layers=LAYERS,
            page_bytes=PAGE_BYTES,
            dram_bytes=8 << 20,
            ssd_file_bytes=8 << 20,
            fsync=False,
        )
        with FlatCakeStore(config) as store:
            per_call(store, args.repeats, 20_000)
            hot_path(store, args.repeats, 300)


if __name__ == "__main__":
    main()
