"""What sealing a tenant's SSD pages at rest costs (issue 23: ``cuda_ext/host_seal.py``).

One store, two tenants of the same geometry: ``plain`` (no key: written as it comes, as the
default tenant of an open service is) and ``sealed`` (its key learnt, as a storage node
learns it from a call). Each round puts ``--pages`` pages x ``--layers`` layers on SSD for
both and restores both, in alternation (plain, sealed, sealed, plain, ...), every restore
checked byte for byte; medians of ``--rounds``, and the median of each round's sealed/plain
pair (the drive's rate swings between rounds more than sealing costs). Also the cipher alone on
64 KiB blocks.

    .venv/bin/python -m benchmarks.sealed_ssd [--pages 3421] [--layers 4] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from flatcake_ray.config import PlacementConfig, StoreConfig
from flatcake_ray.core.tenants import Tenant, new_secret, seal_key, secret_hash
from flatcake_ray.cuda_ext.host_seal import ctr_rows
from flatcake_ray.node.store import FlatCakeStore, PutHints

SSD = PutHints(turn=1)
BLOCK = 64 << 10


def cipher_gbps(nbytes: int, repeats: int) -> float:
    buffer = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    blocks = nbytes // BLOCK
    offsets = np.arange(blocks, dtype=np.int64) * BLOCK
    lengths = np.full(blocks, BLOCK, dtype=np.int64)
    sums = np.arange(blocks, dtype=np.uint64)
    key = seal_key(new_secret())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ctr_rows(key, buffer, offsets, lengths, sums)
        times.append(time.perf_counter() - start)
    return blocks * BLOCK / statistics.median(times) / 1e9


def run(pages: int, layers: int, page_bytes: int, rounds: int, root: str) -> dict[str, float]:
    nbytes = layers * pages * page_bytes
    file_bytes = ((nbytes * 2 * (rounds + 2)) // (1 << 20) + 64) << 20  # every round's pages
    config = StoreConfig(
        root=root, layers=layers, page_bytes=page_bytes, dram_bytes=64 << 20,
        ssd_files_per_dir=1, ssd_file_bytes=file_bytes, fsync=False,
        placement=PlacementConfig(dram_policy="table2"),
    )  # fmt: skip
    kv = np.random.default_rng(7).integers(0, 256, (layers, pages, page_bytes), dtype=np.uint8)
    out = np.zeros_like(kv)
    times: dict[str, list[float]] = {}
    with FlatCakeStore(config) as store:
        for name in ("plain", "sealed"):
            secret = new_secret()
            store.set_tenant(Tenant(name, secret_hash(secret), layers, page_bytes))
            if name == "sealed":
                store.tenancy.learn_seal(name, seal_key(secret))
        for r in range(rounds + 1):  # round 0 warms up, untimed
            order = ("plain", "sealed") if r % 2 else ("sealed", "plain")
            for name in order:
                keys = [f"{name}-{r}-{i}" for i in range(pages)]
                start = time.perf_counter()
                store.put(keys, kv, hints=SSD, tenant=name)
                put_s = time.perf_counter() - start
                out.fill(0)
                start = time.perf_counter()
                got = store.get(keys, out, tenant=name)
                restore_s = time.perf_counter() - start
                if got != pages or not np.array_equal(out, kv):
                    raise AssertionError(f"{name}: wrong bytes ({got} pages)")
                if r:
                    times.setdefault(f"{name} put", []).append(put_s)
                    times.setdefault(f"{name} restore", []).append(restore_s)
    rates = {row: nbytes / statistics.median(t) / 1e9 for row, t in times.items()}
    for op in ("put", "restore"):  # each round's pair, taken back to back
        pairs = zip(times[f"plain {op}"], times[f"sealed {op}"], strict=True)
        rates[f"paired {op}"] = statistics.median(plain / sealed for plain, sealed in pairs)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=3421)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--page-bytes", type=int, default=16 << 10)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"load average: {os.getloadavg()[0]:.2f} before")
    with tempfile.TemporaryDirectory(dir="/var/tmp") as root:
        rates = run(args.pages, args.layers, args.page_bytes, args.rounds, root)
    cipher = cipher_gbps(64 << 20, 7)
    print(f"load average: {os.getloadavg()[0]:.2f} after")
    print("| row | plain GB/s | sealed GB/s | sealed / plain | median of the rounds' pairs |")
    print("|---|---:|---:|---:|---:|")
    for op in ("put", "restore"):
        plain, sealed, paired = rates[f"plain {op}"], rates[f"sealed {op}"], rates[f"paired {op}"]
        print(
            f"| local SSD {op} | {plain:.2f} | {sealed:.2f} | {sealed / plain:.2f} | {paired:.2f} |"
        )
    print(f"\nthe cipher alone, 64 KiB blocks, over the idle copy threads: {cipher:.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
