"""What checking DRAM pages costs a restore and a put, side by side in one run.

Restore: one in-process store, its DRAM pages read through the local mapped path (the path
clients on the owner's node take) with ``verify_dram`` off (read in place, unchecked) and on
(the default: each mapped chunk copied out, checked, delivered from the copy), alternating.
Put: what a client that writes in place adds, the block checksums of each layer it wrote,
beside the copy into the owner's memory itself.

.venv/bin/python benchmarks/verify_dram_cost.py [--pages 256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from flatcake_ray.config import PlacementConfig, StoreConfig
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.integrity import block_checksums
from flatcake_ray.node.store import FlatCakeStore

LAYERS, PAGE_BYTES = 32, 16 << 10
DRAM = PutHints(turn=2, prior_reply_tokens=1, context_tokens=1)


def store_at(root: str, verify: bool, pages: int) -> FlatCakeStore:
    return FlatCakeStore(
        StoreConfig(
            root=root,
            layers=LAYERS,
            page_bytes=PAGE_BYTES,
            dram_bytes=2 * LAYERS * pages * PAGE_BYTES + (64 << 20),
            ssd_file_bytes=8 << 20,
            ssd_files_per_dir=1,
            fsync=False,
            verify_dram=verify,
            placement=PlacementConfig(dram_policy="table2"),
        )
    )


def restore_seconds(pages: int, repeats: int) -> dict[bool, list[float]]:
    """Seconds per restore with ``verify_dram`` off and on, the two stores alternating."""
    keys = [f"k{i}" for i in range(pages)]
    data = np.random.default_rng(1).integers(0, 256, (LAYERS, pages, PAGE_BYTES), np.uint8)
    out = np.zeros_like(data)
    with tempfile.TemporaryDirectory() as root:
        stores = {v: store_at(os.path.join(root, str(v)), v, pages) for v in (False, True)}
        try:
            for store in stores.values():
                store.put(keys, data, hints=DRAM)
                assert store.get(keys, out) == pages  # warm: mapped, faulted in
            samples: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(repeats):
                for verify, store in stores.items():
                    began = time.perf_counter()
                    assert store.get(keys, out) == pages
                    samples[verify].append(time.perf_counter() - began)
            assert np.array_equal(out, data)
            return samples
        finally:
            for store in stores.values():
                store.close()


def put_side(pages: int, repeats: int) -> tuple[float, float]:
    """Seconds to copy a put's layers into memory, and to checksum them (medians)."""
    data = np.random.default_rng(2).integers(0, 256, (LAYERS, pages, PAGE_BYTES), np.uint8)
    target = np.empty_like(data)
    copies, sums = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        target[:] = data
        copies.append(time.perf_counter() - began)
        began = time.perf_counter()
        for layer in range(LAYERS):
            block_checksums(data[layer].reshape(-1), 64 << 10)
        sums.append(time.perf_counter() - began)
    return statistics.median(copies), statistics.median(sums)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    nbytes = LAYERS * args.pages * PAGE_BYTES
    print(f"load average at start: {os.getloadavg()[0]:.1f}; {nbytes >> 20} MiB per restore")
    samples = restore_seconds(args.pages, args.repeats)
    off, on = (statistics.median(samples[verify]) for verify in (False, True))
    print(f"restore, verify_dram off: {nbytes / off / 1e9:.2f} GB/s")
    print(f"restore, verify_dram on:  {nbytes / on / 1e9:.2f} GB/s ({on / off:.2f}x the time)")
    copy, sums = put_side(args.pages, args.repeats)
    print(f"put, copy into memory: {nbytes / copy / 1e9:.2f} GB/s")
    print(f"put, writer checksums: {nbytes / sums / 1e9:.2f} GB/s (+{sums / copy:.2f}x the copy)")


if __name__ == "__main__":
    main()
