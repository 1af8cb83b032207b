"""What a running SSD pool prewrite (``ssd_prewrite``) costs a young node's live I/O, paced
(each step waits while others use the drive: ``media/drive_activity.py``) and unpaced.

Run: ``.venv/bin/python -m benchmarks.prewrite_beside_io [--pool-gib 6] [--mib 224]
[--rounds 7] [--dir /var/tmp]``

A fresh pool of ``--pool-gib`` GiB (two files) on ``--dir``'s disk, its prewrite started as a
store starts it; ``--mib`` MiB of data written at its start, then, while the prewrite still
runs, rounds of: the data read back as a local SSD restore reads it (the pool's read engine,
``LocalSsdTransport``: 4 MiB commands, 4 in flight) and overwritten as a put writes it (one
O_DIRECT command a 56 MiB layer). The same rounds once the prewrite is done are the
baseline. Each way in a fresh pool; paced and unpaced alternate ``--passes`` times. Prints
median GB/s of the rounds that ran beside the prewrite, their ratio to the baseline, and how
much the prewrite wrote meanwhile.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from flatcake_ray.cli.benchkit import aligned_buffer
from flatcake_ray.media.pool import SsdPool
from flatcake_ray.transports.base import ReadBatch
from flatcake_ray.transports.local_ssd import LocalSsdTransport

LAYER = 56 << 20


def rounds_of(pool: SsdPool, data: np.ndarray, rounds: int, beside: bool) -> dict[str, list]:
    """``rounds`` reads and overwrites of ``data`` at the pool's start; ``beside``: only
    those that start while the prewrite still has bytes to write."""
    reader = LocalSsdTransport(pool)
    into = aligned_buffer(data.nbytes)
    batch = ReadBatch.packed([0], [data.nbytes])
    found: dict[str, list] = {"read": [], "write": []}
    for _ in range(rounds):
        if beside and not pool.prewrite_pending:
            break
        started = time.perf_counter()
        reader.read(batch, into)
        found["read"].append(data.nbytes / (time.perf_counter() - started) / 1e9)
        started = time.perf_counter()
        for at in range(0, data.nbytes, LAYER):
            pool.write(at, data[at : at + LAYER])
        found["write"].append(data.nbytes / (time.perf_counter() - started) / 1e9)
    if not np.array_equal(into, data):
        raise AssertionError("the data read back is not what was written")
    return found


def one_pool(where: str, file_bytes: int, data: np.ndarray, rounds: int, paced: bool) -> dict:
    folder = tempfile.mkdtemp(dir=where, prefix="prewrite-bench-")
    try:
        pool = SsdPool((folder,), 2, file_bytes, prewrite=True, prewrite_paced=paced)
        try:
            for at in range(0, data.nbytes, LAYER):  # the node's first put
                pool.write(at, data[at : at + LAYER])
            pending = pool.prewrite_pending
            beside = rounds_of(pool, data, rounds, beside=True)
            written = pending - pool.prewrite_pending
            deadline = time.monotonic() + 120
            while pool.prewrite_pending and time.monotonic() < deadline:
                time.sleep(0.05)  # idle drive: a paced prewrite runs at full speed now
            alone = rounds_of(pool, data, rounds, beside=False)
        finally:
            pool.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"beside": beside, "alone": alone, "prewritten_mib": written / 2**20}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prewrite_beside_io")
    parser.add_argument("--pool-gib", type=float, default=6.0)
    parser.add_argument("--mib", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--dir", default="/var/tmp")
    args = parser.parse_args(argv)
    nbytes = args.mib << 20
    data = aligned_buffer(nbytes)
    data[:] = np.random.default_rng(0).integers(0, 256, nbytes, np.uint8)
    file_bytes = int(args.pool_gib * 2**30) // 2 // 4096 * 4096
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    results: dict[str, list[dict]] = {"unpaced": [], "paced": []}
    for _ in range(args.passes):
        for way in results:
            results[way].append(one_pool(args.dir, file_bytes, data, args.rounds, way == "paced"))
    for way, runs in results.items():
        for kind in ("read", "write"):
            beside = statistics.median(r for run in runs for r in run["beside"][kind])
            alone = statistics.median(r for run in runs for r in run["alone"][kind])
            count = sum(len(run["beside"][kind]) for run in runs)
            print(
                f"{way:8s} {kind:5s} beside the prewrite {beside:.2f} GB/s ({count} rounds), "
                f"alone {alone:.2f}: {beside / alone:.2f}"
            )
        written = [round(run["prewritten_mib"]) for run in runs]
        print(f"{way:8s} prewritten during those rounds: {written} MiB")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
