"""Opening an SSD pool's manifest (format 2): replay plus compaction, against the bare
msgpack decode of the same records (what format 1 cost), side by side in one run.

    .venv/bin/python benchmarks/manifest_replay.py --records 20000 --pages 64 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np

from flatcake_ray.node.manifest import Manifest
from flatcake_ray.node.manifest_frames import FRAME_OVERHEAD

LAYERS, PAGE_BYTES, FILE_BYTES = 32, 16 << 10, 1 << 30


def seg_record(scope: int, segment: int, pages: int, offset: int) -> dict:
    rng = np.random.default_rng(segment)
    digests = rng.integers(0, 1 << 63, 2 * pages, dtype=np.uint64)
    digests[0::2] |= np.uint64(1 << 63)
    nbytes = LAYERS * pages * PAGE_BYTES
    return {
        "t": "seg",
        "scope": scope,
        "session": f"session-{scope}",
        "segment": segment,
        "offset": offset,
        "pages": pages,
        "digests": digests.tobytes(),
        "checksums": rng.integers(0, 1 << 63, LAYERS, dtype=np.uint64).tobytes(),
        "runs": [[offset // FILE_BYTES, offset, nbytes, nbytes]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    nbytes = LAYERS * args.pages * PAGE_BYTES
    per_file = FILE_BYTES // nbytes
    files = -(-args.records // per_file)
    header = {"layers": LAYERS, "page_bytes": PAGE_BYTES, "file_bytes": FILE_BYTES, "files": files}
    records = [
        seg_record(
            i + 1,
            args.records + i + 1,
            args.pages,
            (i // per_file) * FILE_BYTES + (i % per_file) * nbytes,
        )
        for i in range(args.records)
    ]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "manifest.fcm"
        manifest = Manifest(str(path), header, fsync=False)
        for record in records:
            manifest.append(record)
        manifest.close()
        framed = path.read_bytes()
        bare = b"".join(msgpack.packb(r, use_bin_type=True) for r in records)
        opens, decodes = [], []
        for _ in range(args.repeats):
            path.write_bytes(framed)
            started = time.perf_counter()
            reopened = Manifest(str(path), header, fsync=False)
            opens.append(time.perf_counter() - started)
            assert len(reopened.recovered) == args.records
            reopened.close()
            started = time.perf_counter()
            unpacker = msgpack.Unpacker(raw=False)
            unpacker.feed(bare)
            assert sum(1 for _ in unpacker) == args.records
            decodes.append(time.perf_counter() - started)
    open_s, decode_s = statistics.median(opens), statistics.median(decodes)
    print(
        f"{args.records} seg records of {args.pages} pages, {len(framed) / 2**20:.1f} MiB "
        f"(framing {FRAME_OVERHEAD} B/record, {FRAME_OVERHEAD * len(records) / len(framed):.1%})"
    )
    print(
        f"format 2 open (replay, checks, compaction): {open_s * 1e3:.0f} ms median of "
        f"{args.repeats}, {open_s / args.records * 1e6:.1f} us/record"
    )
    print(
        f"bare msgpack decode of the same records:    {decode_s * 1e3:.0f} ms "
        f"(ratio {open_s / decode_s:.1f}x)"
    )


if __name__ == "__main__":
    main()
