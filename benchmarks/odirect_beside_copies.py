"""What an SSD restore's checks cost its reads: O_DIRECT reads alone, and beside the work a
checked restore does with each slot it read (on this machine the drive slows when the CPUs
work beside it).

Run: ``.venv/bin/python -m benchmarks.odirect_beside_copies [--mib 224] [--rounds 9]
[--dir /var/tmp]``

One file of ``--mib`` MiB on ``--dir``'s disk, read sequentially with O_DIRECT the way the
restore pipeline reads it (16 MiB slots, each cut into 4 MiB commands on 4 threads), three
ways, in turn, ``--rounds`` times: **reads** alone (into one buffer); **+ hash**: each slot,
once read, hashed block by block (xxh3-64, 64 KiB blocks, on the idle copy threads) while
the next slot is read, as a check in place would; **+ copy and hash**: each slot read into
one of two staging slots, then copied into the destination and hashed in one pass while the
next is read, as the checked restore does (``restore/copy_check.py``). Prints the median and
best GB/s of each, and the medians' ratio to reads alone.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from flatcake_ray.cli.benchkit import aligned_buffer

SLOT = 16 << 20
PIECE = 4 << 20
BLOCK = 64 << 10


class Reader:
    def __init__(self, path: str, nbytes: int) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        self.nbytes = nbytes
        self.pool = ThreadPoolExecutor(4)

    def slot(self, into: np.ndarray, at: int, offset: int, length: int) -> None:
        """Bytes ``[offset, offset + length)`` into ``into[at:]``, 4 commands in flight."""

        def one(piece: int) -> None:
            n = min(PIECE, length - piece)
            os.preadv(self.fd, [memoryview(into[at + piece : at + piece + n])], offset + piece)

        for future in [self.pool.submit(one, p) for p in range(0, length, PIECE)]:
            future.result()

    def slots(self) -> list[tuple[int, int]]:
        return [(o, min(SLOT, self.nbytes - o)) for o in range(0, self.nbytes, SLOT)]


def beside(reader: Reader, read_one: Callable, work: Callable) -> None:
    """Read every slot; ``work`` takes each read slot on another thread while the next is read."""
    handed: queue.Queue = queue.Queue(maxsize=1)

    def worker() -> None:
        while (item := handed.get()) is not None:
            work(*item)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        for offset, length in reader.slots():
            handed.put(read_one(offset, length))
    finally:
        handed.put(None)
        thread.join()


def main(argv: list[str] | None = None) -> int:
    from flatcake_ray.cuda_ext.host_hash import copy_hashing_source, xxh3_many

    parser = argparse.ArgumentParser(prog="python -m benchmarks.odirect_beside_copies")
    parser.add_argument("--mib", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dir", default="/var/tmp")
    args = parser.parse_args(argv)
    nbytes = args.mib << 20
    dest, staging = aligned_buffer(nbytes), [aligned_buffer(SLOT), aligned_buffer(SLOT)]
    with tempfile.NamedTemporaryFile(dir=args.dir) as scratch:
        scratch.write(np.random.default_rng(0).integers(0, 256, nbytes, np.uint8).tobytes())
        scratch.flush()
        os.fsync(scratch.fileno())
        reader = Reader(scratch.name, nbytes)
        turn = iter(range(1 << 30))

        def into_dest(offset: int, length: int) -> tuple[int, int]:
            reader.slot(dest, offset, offset, length)
            return offset, length

        def into_staging(offset: int, length: int) -> tuple[np.ndarray, int, int]:
            slot = staging[next(turn) % 2]  # two slots: one read while the other is emptied
            reader.slot(slot, 0, offset, length)
            return slot, offset, length

        def hash_slot(offset: int, length: int) -> None:
            xxh3_many([dest[b : b + BLOCK] for b in range(offset, offset + length, BLOCK)])

        def copy_slot(slot: np.ndarray, offset: int, length: int) -> None:
            copy_hashing_source(dest[offset : offset + length], slot[:length], BLOCK)

        ways = {
            "reads": lambda: [into_dest(o, n) for o, n in reader.slots()],
            "+ hash": lambda: beside(reader, into_dest, hash_slot),
            "+ copy and hash": lambda: beside(reader, into_staging, copy_slot),
        }
        rates: dict[str, list[float]] = {name: [] for name in ways}
        print(f"load average at the start: {os.getloadavg()[0]:.2f}")
        for _ in range(args.rounds):
            for name, way in ways.items():
                started = time.perf_counter()
                way()
                rates[name].append(nbytes / (time.perf_counter() - started) / 1e9)
        alone = statistics.median(rates["reads"])
        for name, found in rates.items():
            median = statistics.median(found)
            print(
                f"{name:16s} median {median:.2f} GB/s, best {max(found):.2f}, "
                f"{median / alone:.2f} of reads alone"
            )
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
