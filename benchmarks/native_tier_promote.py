"""Promotion into vLLM's CPU tier: FlatCake-Ray's tier beside vLLM's own ``fs`` tier.

``VLLM_TARGET_DEVICE=cpu .venv-engines/bin/python benchmarks/native_tier_promote.py``

The part of a native-offloading TTFT that runs on any machine: vLLM's real tiering manager
(``TieringOffloadingSpec``: CPU primary tier on its shared region, the secondary tier made
from its config entry), driven as its connector drives it (``tests/integrations/
vllm_tier_harness.py``). Engine A's CPU tier stores a prefix of ``--chunks`` chunks and
cascades it into the tier; a fresh engine B, its CPU tier empty, looks the prefix up step by
step until every chunk is promoted into its CPU tier. The figure is the wall time of B's
lookup-to-all-HIT, median of ``--repeats`` distinct prefixes, side by side in one run:

- FlatCake tier, prefix placed in DRAM (a later turn after a short reply),
- FlatCake tier, prefix placed on SSD (a first turn),
- vLLM's ``fs`` tier (files under a temporary folder; O_DIRECT where the file system allows).

The CPU->GPU copy that follows is the same for every tier and is not in the figure (no GPU
here). A loaded machine: the load average at start is printed; ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from flatcake_ray.integrations._common import Geometry, open_store, release_store  # noqa: E402
from flatcake_ray.integrations.vllm_tier import tier_config  # noqa: E402
from tests.integrations.vllm_tier_harness import NativeEngine, chunk_keys  # noqa: E402

DRAM = {"flatcake_turn": 2, "flatcake_prior_reply_tokens": 16}
SSD = {"flatcake_turn": 1}


def promote_once(
    tier: dict, params: dict, seed: str, args: argparse.Namespace
) -> tuple[float, int]:
    sizes = {"block_bytes": args.chunk_bytes, "chunks": 2 * args.chunks}
    keys = chunk_keys(args.chunks, seed=seed)
    first = NativeEngine(tier, **sizes)
    try:
        first.store(first.request("a", keys, **params), keys)
        first.settle()
    finally:
        first.shutdown()
    second = NativeEngine(tier, **sizes)
    try:
        context = second.request("b", keys, **params)
        started = time.perf_counter()
        found = second.lookup(context, keys, step_s=args.step_ms / 1e3)
        elapsed = time.perf_counter() - started
        if found != len(keys):
            raise SystemExit(f"{seed}: {found} of {len(keys)} chunks promoted")
        return elapsed, second.steps
    finally:
        second.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=32, help="chunks in the prefix")
    parser.add_argument(
        "--chunk-bytes", type=int, default=256 << 10, help="bytes per chunk (4 KiB multiple)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--step-ms",
        type=float,
        default=10.0,
        help="time between the engine's steps while it waits (the figure's resolution)",
    )
    args = parser.parse_args()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="fc-native-tier-") as tmp:
        store = {
            "store": "local",
            "store_root": f"{tmp}/store",
            "store_dram_bytes": f"{4 * args.chunks * args.chunk_bytes * args.repeats}",
            "store_ssd_file_bytes": f"{4 * args.chunks * args.chunk_bytes * args.repeats}",
            "store_fsync": False,
        }
        systems = {
            "FlatCake tier, DRAM": (tier_config(**store), DRAM),
            "FlatCake tier, SSD": (tier_config(**store), SSD),
            "vLLM fs tier": ({"type": "fs", "root_dir": f"{tmp}/fs"}, {}),
        }
        times: dict[str, list[float]] = {name: [] for name in systems}
        steps: dict[str, list[int]] = {name: [] for name in systems}
        # Held open, as a long-lived engine process would: engine A's shutdown must not
        # close the in-process store (and its DRAM) before engine B reads it.
        held = open_store(store, Geometry(1, args.chunk_bytes))
        try:
            for repeat in range(args.repeats):  # interleaved: each system sees the same load
                for index, (name, (tier, params)) in enumerate(systems.items()):
                    seed = f"r{repeat}s{index}"
                    elapsed, took = promote_once(tier, params, seed, args)
                    times[name].append(elapsed)
                    steps[name].append(took)
        finally:
            release_store(held)
    print(f"load average at start: {load}")
    print(
        f"prefix: {args.chunks} chunks of {args.chunk_bytes} bytes; {args.repeats} repeats; "
        f"a step every {args.step_ms:g} ms while waiting"
    )
    base = statistics.median(times["vLLM fs tier"])
    for name, runs in times.items():
        median = statistics.median(runs)
        took = statistics.median(steps[name])
        print(
            f"{name:22s} {1e3 * median:9.1f} ms   {median / base:5.2f}x the fs tier"
            f"   {took:g} steps"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
