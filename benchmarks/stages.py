"""Where a restore's and a put's time goes, stage by stage, on every local and remote path.

Run: ``.venv/bin/python -m benchmarks.stages [--ray] [--before DIR] [--rounds 5]
[--ray-paths dram-local dram-remote ssd-local ssd-remote] [--no-local]
[--json bench_out/stages.json] [--md bench_out/stages.md]``

The stages are the code's own functions, timed from outside (``StageClock`` wraps them for
the run and puts them back): lease (lookup, key digests, the owner's call), plan, fill (reads
into staging: O_DIRECT, NIXL), checksums, scatter (the copies into the destination), release;
for a put: open (planning, ``begin_put``), copy (into the arena, the landing slots or the
staging), checksums, drive (O_DIRECT write and sync), land and commit calls. A stage's
figure is milliseconds per operation summed over every thread that ran it, so stages that
overlap (a window's reads and its scatter) can add up to more than the wall time.

Each path is set against its limit measured in the same process right beside it (memcpy of
the same bytes for DRAM, sequential O_DIRECT read or write for SSD); every figure is the median
of ``--rounds`` operations, every restore is checked byte for byte.

``--before DIR`` runs the same measurements on another checkout (``git worktree add DIR
main``) in alternation with this one (before, after, before, after, ...) so a comparison on a
busy machine sets both against limits sampled at the same moments. ``--ray`` adds the Ray
client's paths (a 2-node cluster on 127.0.0.1; ``benchmarks/stages_ray.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from typing import Any

import numpy as np

from benchmarks.stage_clock import StageClock, medians, summarise

RAY_PATHS = ("dram-local", "dram-remote", "ssd-local", "ssd-remote")  # --ray-paths


# ---- in process: the node's own store --------------------------------------------------------
def run_local(pages: int, layers: int, page_bytes: int, rounds: int, root: str) -> dict:
    """Local DRAM and SSD, restore and put, through ``FlatCakeStore`` (one process)."""
    from flatcake_ray.cli.benchkit import memcpy_gbps, odirect_read_gbps, odirect_write_gbps
    from flatcake_ray.config import PlacementConfig, StoreConfig
    from flatcake_ray.node.store import FlatCakeStore, PutHints

    nbytes = layers * pages * page_bytes
    file_bytes = ((nbytes * (rounds + 3)) // (1 << 20) + 64) << 20
    config = StoreConfig(
        root=root, layers=layers, page_bytes=page_bytes,
        dram_bytes=((nbytes * (rounds + 3)) // (1 << 20) + 64) << 20,
        ssd_files_per_dir=1, ssd_file_bytes=file_bytes, fsync=False,
        placement=PlacementConfig(dram_policy="table2"),
    )  # fmt: skip
    hints = {
        "DRAM": PutHints(turn=2, prior_reply_tokens=1, context_tokens=1),
        "SSD": PutHints(turn=1),
    }
    kv = np.random.default_rng(7).integers(0, 256, (layers, pages, page_bytes), dtype=np.uint8)
    out = np.zeros_like(kv)
    scratch = os.path.join(root, "limit.bin")
    limit_of = {
        "DRAM": lambda op: memcpy_gbps(nbytes, 3),
        "SSD": lambda op: (
            odirect_read_gbps([scratch], nbytes, nbytes, 2)
            if op == "restore"
            else odirect_write_gbps(scratch, kv, 2)
        ),
    }
    odirect_write_gbps(scratch, kv, 1)  # the read limit's file
    results: dict[str, Any] = {}
    clock = StageClock().install()
    try:
        with FlatCakeStore(config) as store:
            for medium in ("DRAM", "SSD"):
                rows: dict[str, list[dict[str, float]]] = {"put": [], "restore": []}
                limits: dict[str, list[float]] = {"put": [], "restore": []}
                session = None
                for r in range(rounds + 1):  # round 0 warms up, untimed
                    keys = [f"{medium}-{r}-{i}" for i in range(pages)]
                    limits["put"].append(limit_of[medium]("put"))
                    sink: list[dict[str, float]] = rows["put"] if r else []
                    with clock.op(sink):
                        result = store.put(keys, kv, hints=hints[medium])
                    if result.medium.name != medium:
                        raise AssertionError(f"a {medium} put landed on {result.medium}")
                    session = keys  # the newest: reclamation frees the oldest first
                for r in range(rounds + 1):
                    limits["restore"].append(limit_of[medium]("restore"))
                    out.fill(0)
                    sink = rows["restore"] if r else []
                    with clock.op(sink):
                        got = store.get(session, out)
                    if got != pages or not np.array_equal(out, kv):
                        raise AssertionError(f"local {medium}: wrong bytes ({got} pages)")
                for op in ("restore", "put"):
                    results[f"local {medium} {op}"] = summarise(nbytes, rows[op], limits[op][1:])
    finally:
        clock.uninstall()
    return results


# ---- before and after, in alternation --------------------------------------------------------
def import_tree(checkout: str, into: str) -> str:
    """A folder where ``import flatcake_ray`` finds ``checkout``'s code whole (the packages
    setuptools maps from the repository root copied in place), measured by this tree's
    benchmarks (the tools stay the same, the code measured changes)."""
    package = os.path.join(into, "flatcake_ray")
    shutil.copytree(os.path.join(checkout, "flatcake_ray"), package, dirs_exist_ok=True)
    for name in ("actors", "transports", "cuda_ext"):
        shutil.copytree(os.path.join(checkout, name), os.path.join(package, name))
    here = os.path.dirname(os.path.abspath(__file__))
    shutil.copytree(here, os.path.join(into, "benchmarks"), ignore=shutil.ignore_patterns("*.pyc"))
    return into


def child_run(args: argparse.Namespace, pythonpath: str | None, part: str) -> dict:
    """One part (``local`` or ``ray``) measured in a fresh process; {} when it failed (a
    cluster that cannot start on a busy machine): the other runs still count."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    command = [sys.executable, "-m", "benchmarks.stages", "--child", part]
    command += ["--pages", str(args.pages), "--layers", str(args.layers)]
    command += ["--page-bytes", str(args.page_bytes), "--rounds", str(args.rounds)]
    command += ["--ray-paths", *args.ray_paths]
    cwd = pythonpath or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode:
        print(f"[stages] a {part} run failed, left out:\n{done.stderr[-2000:]}", file=sys.stderr)
        return {}
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace) -> dict:
    root = tempfile.mkdtemp(prefix="flatcake-stages-", dir="/var/tmp")
    try:
        if args.child == "ray":
            from benchmarks.stages_ray import run_ray

            paths = tuple(args.ray_paths)
            return run_ray(args.pages, args.layers, args.page_bytes, args.rounds, root, paths)
        return run_local(args.pages, args.layers, args.page_bytes, args.rounds, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def markdown(results: dict[str, Any]) -> str:
    """One table per code version: each path's rate, limit, fraction and stages (ms/op)."""
    lines = [f"load average: {results['load_before']} before, {results['load_after']} after", ""]
    for version, rows in results["versions"].items():
        stages = sorted({s for row in rows.values() for s in row["stages_ms"] if s != "wall"})
        lines += [f"**{version}**", ""]
        lines.append("| path | GB/s | limit | fraction | wall ms | " + " | ".join(stages) + " |")
        lines.append("|---|---:|---:|---:|---:|" + "---:|" * len(stages))
        for path, row in rows.items():
            cells = [f"{row['stages_ms'].get(s, 0.0):.1f}" for s in stages]
            lines.append(
                f"| {path} | {row['gbps']:.2f} | {row['limit_gbps']:.2f} | {row['fraction']:.2f} "
                f"| {row['stages_ms']['wall']:.1f} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    return "\n".join(lines)


def combine(runs: list[dict]) -> dict:
    """Several runs of one version: per path the median of each figure."""
    out = {}
    for path in sorted({path for run in runs for path in run}, key=_path_order):
        rows = [run[path] for run in runs if path in run]
        stages = medians([row["stages_ms"] for row in rows])
        gbps = statistics.median([row["gbps"] for row in rows])
        limit = statistics.median([row["limit_gbps"] for row in rows])
        fraction = statistics.median([row["fraction"] for row in rows])
        out[path] = {"gbps": gbps, "limit_gbps": limit, "fraction": fraction, "stages_ms": stages}
    return out


def _path_order(path: str) -> tuple[int, str]:
    return (0 if path.startswith("local") else 1, path)  # in process first, then the Ray client


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stages", description=__doc__)
    parser.add_argument("--pages", type=int, default=3421)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--page-bytes", type=int, default=16 << 10)
    parser.add_argument("--rounds", type=int, default=5, help="timed operations per path")
    parser.add_argument("--ray", action="store_true", help="also the Ray client's paths")
    parser.add_argument("--before", help="a checkout to compare with, run in alternation")
    parser.add_argument("--passes", type=int, default=2, help="alternations with --before")
    parser.add_argument("--json", default="bench_out/stages.json")
    parser.add_argument("--md", default="bench_out/stages.md")
    parser.add_argument(
        "--ray-paths",
        nargs="+",
        choices=RAY_PATHS,
        default=list(RAY_PATHS),
        help="with --ray: only these of the Ray client's paths (restore and put each)",
    )
    parser.add_argument("--no-local", action="store_true", help="leave out the in-process rows")
    parser.add_argument("--child", choices=("local", "ray"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    load_before = round(os.getloadavg()[0], 2)
    runs: dict[str, list[dict]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="flatcake-before-") as scratch:
        before = import_tree(args.before, scratch) if args.before else None
        parts = [*([] if args.no_local else ["local"]), *(["ray"] if args.ray else [])]
        for _ in range(args.passes if before else 1):
            for part in parts:  # before and after back to back, part by part
                if before:
                    runs["before"].append(child_run(args, before, part))
                runs["after" if before else "this tree"].append(child_run(args, None, part))
    results = {
        "load_before": load_before,
        "load_after": round(os.getloadavg()[0], 2),
        "command": "python -m benchmarks.stages "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "versions": {
            name: combine([run for run in version_runs if run])
            for name, version_runs in runs.items()
            if any(version_runs)
        },
    }
    for path, text in ((args.json, json.dumps(results, indent=2)), (args.md, markdown(results))):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
