"""``flatcake-ray demo``: the main job on an embedded default.

1. The store, in process, with real bytes: a scaled-down agentic session (every turn
   restores the whole prefix, then appends its new pages), plus short chats beside it.
2. The same workload through the Ray service on a local Ray cluster the demo starts itself.
3. A short replay comparison of flatcake vs tiered vs dram-only on a synthetic agentic trace.
It prints one summary table and writes its JSON and plots under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from flatcake_ray.config import PlacementConfig, StoreConfig
from flatcake_ray.node.store import FlatCakeStore

LAYERS, PAGE_TOKENS, PAGE_BYTES = 16, 256, 16384


def agentic_turns(turns: int, first_pages: int, growth_pages: int) -> list[int]:
    """Context length in pages after each turn: tool outputs append a lot every turn."""
    return [first_pages + growth_pages * t for t in range(turns)]


def run_store_workload(root: str, turns: int = 8, chats: int = 6) -> dict[str, Any]:
    """Write and restore an agentic session and a few short chats with the real store."""
    config = StoreConfig(
        root=root,
        layers=LAYERS,
        page_bytes=PAGE_BYTES,
        dram_bytes=64 << 20,
        ssd_file_bytes=256 << 20,
        ssd_files_per_dir=2,
        fsync=False,
        placement=PlacementConfig(
            page_tokens=PAGE_TOKENS, tau_tokens=1024, l_agent_tokens=16 * PAGE_TOKENS
        ),
    )
    rng = np.random.default_rng(0)
    lengths = agentic_turns(turns, first_pages=8, growth_pages=8)
    kv = rng.integers(0, 256, size=(LAYERS, lengths[-1], PAGE_BYTES), dtype=np.uint8)
    keys = [f"agent-page-{p}" for p in range(lengths[-1])]
    rows = []
    with FlatCakeStore(config) as store:
        previous = 0
        for turn, length in enumerate(lengths, start=1):
            restore = _restore(store, keys[:previous], kv[:, :previous]) if previous else None
            result = store.put(keys[:length], kv[:, :length])
            rows.append(
                {
                    "turn": turn,
                    "context_pages": length,
                    "medium": result.medium,
                    "rule": result.rule,
                    **(restore or {}),
                }
            )
            previous = length
        chat_rows = _run_chats(store, rng, chats)
        stats = store.stats()
    return {"agentic_turns": rows, "chats": chat_rows, "stats": stats}


def _restore(store: FlatCakeStore, keys: list[str], expected: np.ndarray) -> dict[str, Any]:
    before = store.stats()
    out = np.empty_like(expected)
    start = time.perf_counter()
    restored = store.get(keys, out)
    seconds = time.perf_counter() - start
    after = store.stats()
    if restored != len(keys) or not np.array_equal(out, expected):
        raise AssertionError(f"restore returned {restored}/{len(keys)} pages or wrong bytes")
    return {
        "restored_pages": restored,
        "restore_seconds": seconds,
        "restore_gbps": expected.nbytes / seconds / 1e9,
        "ssd_reads": after["ssd_read_commands"] - before["ssd_read_commands"],
    }


def _run_chats(store: FlatCakeStore, rng: np.random.Generator, chats: int) -> list[dict[str, Any]]:
    """Short chats: turn 1 goes to SSD (one-shot), short later turns to DRAM."""
    rows = []
    for chat in range(chats):
        kv = rng.integers(0, 256, size=(LAYERS, 3, PAGE_BYTES), dtype=np.uint8)
        keys = ["system-prompt", f"chat-{chat}-q1", f"chat-{chat}-q2"]
        first = store.put(keys[:2], kv[:, :2])
        second = store.put(keys, kv)
        restored = store.get(keys, np.empty_like(kv))
        rows.append(
            {
                "chat": chat,
                "turn1": f"{first.medium}/{first.rule}",
                "turn2": f"{second.medium}/{second.rule}",
                "restored_pages": restored,
            }
        )
    return rows


def print_store_summary(result: dict[str, Any]) -> None:
    print("\n== 1. Store, in process: one agentic session (restore the prefix, then append) ==")
    header = ("turn", 4), ("pages", 6), ("medium", 6), ("rule", 13), ("restored", 8)
    print(" ".join(f"{name:>{width}}" for name, width in header) + " reads   GB/s")
    for row in result["agentic_turns"]:
        print(
            f"{row['turn']:>4} {row['context_pages']:>6} {row['medium']:>6} {row['rule']:>13} "
            f"{row.get('restored_pages', 0):>8} {row.get('ssd_reads', 0):>5} "
            f"{row.get('restore_gbps', 0):>6.2f}"
        )
    print("\nShort chats beside it (turn 1 / turn 2 medium and rule):")
    for row in result["chats"]:
        turns = f"{row['turn1']:<18} {row['turn2']:<18}"
        print(f"  chat {row['chat']}: {turns} restored {row['restored_pages']}")
    stats = result["stats"]
    read_mib = stats["ssd_bytes_read"] / 2**20
    print(
        f"\nstore: {stats['pages_indexed']} pages indexed, "
        f"{stats['index_bytes_per_page']:.0f} B/page of index, "
        f"{stats['ssd_read_commands']} SSD reads for {read_mib:.0f} MiB, "
        f"placement rules {stats['placement_rules']}"
    )


def run_service_restores(root: str) -> dict[str, Any]:
    """The Ray service on a local two-node Ray cluster it starts itself (127.0.0.1): one
    session per medium written on node A, restored on A and on B, with each path's limit
    measured beside it (the cross-node restore benchmark at demo size)."""
    from flatcake_ray.cli.bench import add_bench_arguments, run_bench

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # stay on loopback
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)  # every option the benchmark reads, at its default
    demo_size = ["--pages", "512", "--layers", str(LAYERS), "--page-bytes", str(PAGE_BYTES)]
    where = ["--root", os.path.join(root, "service")]
    args = parser.parse_args([*demo_size, "--repeats", "2", *where])
    return run_bench(args)


def print_service_summary(result: dict[str, Any]) -> None:
    from flatcake_ray.cli.bench import format_results

    config = result["config"]
    print(
        f"\n== 2. Ray service, 2 nodes on 127.0.0.1: a {config['pages']}-page session "
        f"({config['bytes_per_restore'] / 2**20:.0f} MiB) restored per path =="
    )
    print(format_results(result))


REPLAY_SYSTEMS = ("flatcake", "tiered", "dram-only")
# DRAM below the agentic working set: the regime the paper is about (docs/bench_replay.md).
REPLAY_OVERRIDES = {"hbm_kv_bytes": "2GiB", "dram_bytes": "16GiB", "ssd_bytes": "512GiB"}


def run_replay_comparison(out_dir: Path, qps: tuple[float, ...] = (0.25, 1.0)) -> dict[str, Any]:
    """flatcake vs tiered vs dram-only on a scaled-down synthetic agentic trace."""
    from flatcake_ray.replay.report import write_outputs
    from flatcake_ray.replay.sweep import run_comparison
    from flatcake_ray.traces import SyntheticTrace, SynthOptions, Trace

    trace = Trace.from_requests(SyntheticTrace(SynthOptions(profile="agentic", seed=0, scale=0.01)))
    result = run_comparison(
        trace,
        REPLAY_SYSTEMS,
        "deepseek-v4-flash-b200",
        qps,
        (0,),
        profile_overrides=REPLAY_OVERRIDES,
        progress=False,
    )
    result["outputs"] = {k: str(v) for k, v in write_outputs(result, out_dir / "replay").items()}
    return result


def print_replay_summary(result: dict[str, Any]) -> None:
    print(
        "\n== 3. Replay model: synthetic agentic trace (1% of Claude Code), DeepSeek-V4-Flash "
        "on B200, 2 GiB HBM + 2 GiB DRAM per rank (16 GiB per node) =="
    )
    print(
        f"{'system':>10} {'QPS':>5} {'hit %':>6} {'TTFT mean s':>11} {'TTFT P99 s':>10} "
        f"{'SSD read amp':>12}"
    )
    for row in sorted(result["summary"], key=lambda r: (r["x"], r["system"])):
        print(
            f"{row['system']:>10} {row['x']:>5} {_mean(row, 'hit_rate') * 100:>6.1f} "
            f"{_mean(row, 'ttft_mean_s'):>11.2f} {_mean(row, 'ttft_p99_s'):>10.2f} "
            f"{_mean(row, 'ssd_read_amplification'):>12.2f}"
        )
    print("plots: " + ", ".join(v for k, v in result["outputs"].items() if v.endswith(".png")))


def _mean(metrics: dict[str, Any], name: str) -> float:
    value = metrics.get(name, 0.0)
    return float(value["mean"] if isinstance(value, dict) else value)


def main(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="flatcake-demo-") as root:
        summary["store"] = run_store_workload(root)
        print_store_summary(summary["store"])
        summary["service"] = run_service_restores(root)
    print_service_summary(summary["service"])
    summary["replay"] = run_replay_comparison(out_dir)
    print_replay_summary(summary["replay"])
    (out_dir / "demo.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\nwrote {out_dir / 'demo.json'}")
    return 0


def add_demo_command(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="run the main job on a local embedded default")
    parser.add_argument("--out", default="demo_out", help="folder for JSON and plots")
    parser.set_defaults(handler=main)
