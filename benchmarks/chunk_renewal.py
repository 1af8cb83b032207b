"""What giving a chunk a fresh file costs (``DramArena.renew_chunk``: a chunk that goes to
another tenant, issue 23), by chunk size, what the put that takes such a chunk pays with the
renewal under the store's lock and after it was done ahead of time (``hand_over_vacated``),
and what a local reader's check for renewed chunks
adds to a restore's range check (``LocalDramTransport.holds`` on ``--ranges`` ranges over
every chunk of an arena of ``--chunks``). Medians of ``--trials``; ``--before DIR`` times
the range check of another checkout (``git worktree add DIR <commit>``) too, each tree in
fresh processes, alternated three times.

    .venv/bin/python -m benchmarks.chunk_renewal [--sizes-mib 16 64 256] [--chunks 8] [--before DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from flatcake_ray.media.arena import DramArena
from flatcake_ray.media.fd_handout import HandedChunk
from flatcake_ray.transports.local_dram import LocalDramTransport


def renewal_ms(chunk_bytes: int, trials: int) -> float:
    arena = DramArena(2 * chunk_bytes, f"renewal-{os.getpid()}", "off", chunk_bytes)
    try:
        times = []
        for _ in range(trials):
            arena.view[:chunk_bytes] = 1  # the former tenant's pages: memory to give back
            start = time.perf_counter()
            arena.renew_chunk(0)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3
    finally:
        arena.close()


def holds_us(chunks: int, ranges: int, trials: int) -> float:
    chunk_bytes = 4 << 20
    arena = DramArena(chunks * chunk_bytes, f"holds-{os.getpid()}", "off", chunk_bytes)
    handed = [
        HandedChunk(c.offset, c.nbytes, os.dup(arena.chunk_fd(c.offset)))
        for c in map(arena.chunk, range(chunks))
    ]
    reader = LocalDramTransport.attach(lambda: handed, arena.nbytes)
    try:
        starts = np.sort(np.random.default_rng(0).integers(0, arena.nbytes - 16384, ranges))
        lengths = np.full(ranges, 16384, dtype=np.int64)
        times = []
        for _ in range(trials):
            start = time.perf_counter()
            assert reader.holds(starts, lengths)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6
    finally:
        reader.close()
        arena.close()


def taking_put_ms(chunk_bytes: int, trials: int, *, ahead: bool) -> float:
    """A one-page put of a tenant that takes the chunk another tenant left empty: with the
    chunk's fresh file made by that put, under the store's lock, or (``ahead``) made before
    it off the lock (``FlatCakeStore.hand_over_vacated``, what a storage node does before
    each report). A third tenant holds the arena's other chunk throughout."""
    from flatcake_ray.config import StoreConfig
    from flatcake_ray.core.catalog import PutHints
    from flatcake_ray.core.tenants import Tenant, new_secret, secret_hash
    from flatcake_ray.node.store import FlatCakeStore

    page = 4096
    dram = PutHints(turn=2, prior_reply_tokens=1)
    kv = np.ones((1, 1, page), dtype=np.uint8)
    times = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as root:
        config = StoreConfig(
            root=root, layers=1, page_bytes=page, dram_bytes=2 * chunk_bytes, dram_chunks=2,
            ssd_file_bytes=16 << 20, ssd_files_per_dir=1, fsync=False, hugepages="off",
        )  # fmt: skip
        with FlatCakeStore(config) as store:

            def tenant(name: str) -> str:
                store.set_tenant(Tenant(name, secret_hash(new_secret()), 1, page))
                return name

            store.put(["f"], kv, tenant=tenant("filler"), hints=dram)
            for trial in range(trials + 1):
                store.put([f"a{trial}"], kv, tenant=tenant("alpha"), hints=dram)
                store.remove_tenant("alpha")  # its chunk empty, last held by another
                if ahead:
                    store.hand_over_vacated()
                start = time.perf_counter()
                store.put([f"b{trial}"], kv, tenant=tenant("beta"), hints=dram)
                if trial:  # the first warms up
                    times.append(time.perf_counter() - start)
                store.remove_tenant("beta")
    return statistics.median(times) * 1e3


def holds_in(tree: str | None, args: argparse.Namespace) -> float:
    """``holds_us`` measured in a fresh process importing ``tree`` (None: this one)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree
    command = [sys.executable, "-m", "benchmarks.chunk_renewal", "--child-holds"]
    command += ["--chunks", str(args.chunks), "--ranges", str(args.ranges)]
    command += ["--trials", str(args.trials)]
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--ranges", type=int, default=3421)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--before", default=None)
    parser.add_argument("--child-holds", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_holds:
        print(holds_us(args.chunks, args.ranges, args.trials * 20))
        return
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    for mib in args.sizes_mib:
        ms = renewal_ms(mib << 20, args.trials)
        print(f"renew a {mib} MiB chunk: {ms:.1f} ms ({mib / 1024 / (ms / 1e3):.1f} GiB/s)")
        inline = taking_put_ms(mib << 20, args.trials, ahead=False)
        ahead = taking_put_ms(mib << 20, args.trials, ahead=True)
        print(f"  a put taking a {mib} MiB chunk another tenant left: {inline:.1f} ms renewing it")
        print(f"  under the store's lock, {ahead:.2f} ms after it was renewed ahead, off the lock")
    with tempfile.TemporaryDirectory() as scratch:
        from benchmarks.stages import import_tree

        before = import_tree(args.before, scratch) if args.before else None
        for _ in range(3):
            line = f"holds(): {args.ranges} ranges over {args.chunks} chunks: "
            line += f"{holds_in(None, args):.0f} us"
            if before is not None:
                line += f"; before: {holds_in(before, args):.0f} us"
            print(line)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
