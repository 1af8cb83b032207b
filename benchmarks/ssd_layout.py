"""SSD restore of one long session: FlatCake layout vs eviction order vs raw sequential read.

Run: ``.venv/bin/python benchmarks/ssd_layout.py [--pages 128] [--turns 8] [--repeats 5]
[--write-md BENCHMARKS.md]``

All three read the same bytes with O_DIRECT (the page cache is bypassed, and each file is
also dropped from it with POSIX_FADV_DONTNEED before every repeat):
- ``flatcake``: the real store: the session written in ``turns`` puts, restored with ``get``
  (layer-major segments, sort-merge coalesced reads, checksums verified);
- ``eviction-order``: the same page-layers scattered over a file in the order an LRU tier
  evicts them (one page-layer at a time, interleaved with other sessions), read back with one
  command per page-layer, as a tiered store with GDS does;
- ``sequential``: one large O_DIRECT read after another over the same byte count: the drive's
  limit.
It also measures the index's memory per page at 1M pages (catalog only, no bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from flatcake_ray.config import StoreConfig
from flatcake_ray.core.catalog import Catalog
from flatcake_ray.core.keys import digest_keys
from flatcake_ray.media.buffers import AlignedBuffer
from flatcake_ray.node.store import FlatCakeStore

LAYERS, PAGE_TOKENS, BYTES_PER_TOKEN = 43, 256, 7680  # DeepSeek-V4-Flash per rank (paper)
PAGE_LAYER_BYTES = PAGE_TOKENS * BYTES_PER_TOKEN // LAYERS  # 45,723 bytes


def drop_cache(paths):
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def bench_flatcake(root, pages, turns, repeats):
    config = StoreConfig(
        root=root,
        layers=LAYERS,
        page_bytes=PAGE_LAYER_BYTES,
        dram_bytes=0,
        ssd_files_per_dir=1,
        ssd_file_bytes=(pages * LAYERS * PAGE_LAYER_BYTES * 2 // (1 << 20) + 64) << 20,
        fsync=False,
    )
    store = FlatCakeStore(config)
    rng = np.random.default_rng(0)
    kv = rng.integers(0, 256, size=(LAYERS, pages, PAGE_LAYER_BYTES), dtype=np.uint8)
    keys = [f"page-{p}" for p in range(pages)]
    per_turn = pages // turns
    for turn in range(1, turns + 1):
        end = pages if turn == turns else turn * per_turn
        store.put(keys[:end], kv[:, :end])
        store.put([f"other-{turn}"], kv[:, :1])  # another session between turns
    out = np.empty_like(kv)
    times, commands = [], []
    for _ in range(repeats):
        drop_cache(store.pool.paths)
        before = store.stats()
        start = time.perf_counter()
        restored = store.get(keys, out)
        times.append(time.perf_counter() - start)
        after = store.stats()
        commands.append(after["ssd_read_commands"] - before["ssd_read_commands"])
        assert restored == pages and np.array_equal(out, kv)
    read_bytes = after["ssd_bytes_read"] - before["ssd_bytes_read"]
    store.close()
    return {
        "seconds": statistics.median(times),
        "commands": int(statistics.median(commands)),
        "bytes_read": read_bytes,
        "bytes": kv.nbytes,
    }


def bench_eviction_order(root, pages, repeats):
    """Page-layers at scattered 4 KiB-aligned slots, each read with its own command."""
    slot = -(-PAGE_LAYER_BYTES // 4096) * 4096
    count = pages * LAYERS
    path = os.path.join(root, "eviction-order.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.posix_fallocate(fd, 0, 2 * count * slot)  # other sessions' evictions fill the rest
    os.close(fd)
    slots = np.random.default_rng(1).permutation(2 * count)[:count]
    buffer = AlignedBuffer(slot)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    buffer.array[:] = 7
    for s in slots:
        os.pwrite(fd, buffer.array, int(s) * slot)
    times = []
    for _ in range(repeats):
        drop_cache([path])
        start = time.perf_counter()
        # the best a tiered reader can do: sorted, still one command per page-layer
        for s in np.sort(slots):
            os.preadv(fd, [buffer.array], int(s) * slot)
        times.append(time.perf_counter() - start)
    os.close(fd)
    return {
        "seconds": statistics.median(times),
        "commands": count,
        "bytes_read": count * slot,
        "bytes": count * PAGE_LAYER_BYTES,
    }


def bench_sequential(root, nbytes, repeats, chunk=32 << 20):
    path = os.path.join(root, "sequential.bin")
    total = -(-nbytes // chunk) * chunk
    buffer = AlignedBuffer(chunk)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    for offset in range(0, total, chunk):
        os.pwrite(fd, buffer.array, offset)
    times = []
    for _ in range(repeats):
        drop_cache([path])
        start = time.perf_counter()
        for offset in range(0, total, chunk):
            os.preadv(fd, [buffer.array], offset)
        times.append(time.perf_counter() - start)
    os.close(fd)
    return {
        "seconds": statistics.median(times) * nbytes / total,
        "commands": total // chunk,
        "bytes_read": total,
        "bytes": nbytes,
    }


def index_bytes_per_page(pages=1_000_000, batch=4096):
    catalog = Catalog(
        StoreConfig(
            root="unused",
            layers=1,
            page_bytes=4096,
            dram_bytes=0,
            ssd_file_bytes=1 << 40,
            ssd_files_per_dir=4,
        )
    )
    for start in range(0, pages, batch):
        digests = digest_keys("bench", range(start, min(start + batch, pages)))
        catalog.publish(catalog.plan_put(digests))
    index = catalog.index.nbytes
    keys = sum(s.digests.nbytes for s in catalog.segments.values())
    return {
        "pages": pages,
        "hash_table_bytes_per_page": index / pages,
        "with_key_copies_bytes_per_page": (index + keys) / pages,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="folder on the drive to test (default: temp)")
    parser.add_argument("--write-md", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        flat = bench_flatcake(root, args.pages, args.turns, args.repeats)
        evicted = bench_eviction_order(root, args.pages, args.repeats)
        sequential = bench_sequential(root, flat["bytes"], args.repeats)
    rows = {"flatcake": flat, "eviction-order": evicted, "sequential": sequential}
    for row in rows.values():
        row["gbps"] = row["bytes"] / row["seconds"] / 1e9
    result = {
        "session": {
            "layers": LAYERS,
            "pages": args.pages,
            "turns": args.turns,
            "page_layer_bytes": PAGE_LAYER_BYTES,
            "bytes": flat["bytes"],
        },
        "paths": rows,
        "flatcake_vs_eviction_order": flat["gbps"] / evicted["gbps"],
        "flatcake_vs_sequential": flat["gbps"] / sequential["gbps"],
        "index": index_bytes_per_page(),
    }
    print(json.dumps(result, indent=2))
    if args.write_md:
        write_markdown(args.write_md, result, ".venv/bin/python " + " ".join(sys.argv))
    return 0


def write_markdown(path, result, command):
    session = result["session"]
    lines = [
        "## SSD restore of one long session (FC-CIO layout)",
        "",
        f"Command: `{command}`",
        "",
        f"{session['layers']} layers, {session['pages']} pages of 256 tokens at 7.5 KiB/token "
        f"({session['bytes'] / 2**20:.0f} MiB), written in {session['turns']} turns with another "
        "session between turns; O_DIRECT, page cache dropped before each repeat; medians of "
        "repeats, side by side in one run.",
        "",
        "| path | read commands | bytes read / delivered | GB/s |",
        "|---|---:|---:|---:|",
    ]
    for name, row in result["paths"].items():
        lines.append(
            f"| {name} | {row['commands']} | {row['bytes_read'] / row['bytes']:.3f} | "
            f"{row['gbps']:.2f} |"
        )
    index = result["index"]
    lines += [
        "",
        f"FlatCake / eviction order: **{result['flatcake_vs_eviction_order']:.2f}x**; "
        f"FlatCake / sequential limit: **{result['flatcake_vs_sequential']:.2f}**.",
        "",
        f"Index memory at {index['pages']:,} pages: {index['hash_table_bytes_per_page']:.1f} "
        f"bytes/page in the hash table, {index['with_key_copies_bytes_per_page']:.1f} with "
        "the per-segment key copies reclamation needs.",
        "",
    ]
    replace_section(path, "## SSD restore of one long session", "\n".join(lines))


# Ends what a bench writes into its section: the notes written below it (what a run showed,
# earlier runs, stage tables) are kept when the bench writes the section again.
GENERATED_END = "<!-- written by the bench above this line; notes below it are kept -->"


def replace_section(path: str, heading: str, text: str) -> None:
    """Rewrite one ``## `` section of a markdown file, keeping the others and the notes that
    follow the section's ``GENERATED_END`` line."""
    target = Path(path)
    old = target.read_text() if target.exists() else "# Benchmarks\n"
    written = text.rstrip("\n") + "\n\n" + GENERATED_END + "\n"
    start = old.find(heading)
    if start < 0:
        target.write_text(old.rstrip() + "\n\n" + written)
        return
    end = old.find("\n## ", start + 1)
    end = len(old) if end < 0 else end
    marker = old.find(GENERATED_END, start, end)
    kept = old[marker + len(GENERATED_END) + 1 :] if marker >= 0 else old[end:]
    target.write_text(old[:start] + written + kept)


if __name__ == "__main__":
    sys.exit(main())
