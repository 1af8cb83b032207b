"""What a first write into a pre-allocated SSD pool costs: O_DIRECT writes into space the
file system allocated but never wrote (``posix_fallocate``: "unwritten" extents, converted as
they are written) against the same writes into space written once before (what the
bench-peers write limit measures, and what a pool that has wrapped around writes into).

Run: ``.venv/bin/python -m benchmarks.odirect_fresh_space [--mib 224] [--rounds 5]
[--dir /var/tmp]``

Each round makes two files of ``--mib`` MiB on ``--dir``'s disk with ``posix_fallocate``,
writes one of them whole first (and syncs it), then times one pass of sequential 32 MiB
O_DIRECT writes over each; prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from flatcake_ray.cli.benchkit import aligned_buffer

CHUNK = 32 << 20


def write_pass(fd: int, data: np.ndarray, nbytes: int) -> float:
    """Seconds for one pass of ``CHUNK`` O_DIRECT writes over ``nbytes`` of ``fd``."""
    started = time.perf_counter()
    for at in range(0, nbytes, CHUNK):
        os.pwritev(fd, [memoryview(data[: min(CHUNK, nbytes - at)])], at)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.odirect_fresh_space")
    parser.add_argument("--mib", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default="/var/tmp")
    args = parser.parse_args(argv)
    nbytes = args.mib << 20
    data = aligned_buffer(CHUNK)
    data[:] = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)
    rates: dict[str, list[float]] = {"fresh": [], "written before": []}
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    for round_ in range(args.rounds):
        for kind in rates:
            path = os.path.join(args.dir, f"flatcake-fresh-{os.getpid()}-{round_}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
                if kind == "written before":
                    write_pass(fd, data, nbytes)
                    os.fsync(fd)
                rates[kind].append(nbytes / write_pass(fd, data, nbytes) / 1e9)
            finally:
                os.close(fd)
                os.unlink(path)
    fresh, written = (statistics.median(found) for found in rates.values())
    for kind, found in rates.items():
        print(
            f"{kind:15s} median {statistics.median(found):.2f} GB/s {[round(r, 2) for r in found]}"
        )
    print(f"fresh / written before: {fresh / written:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
