"""Run every system on the same workload in one run; write JSON and the Markdown tables.

Phases, in this order, each starting and stopping what it needs: the physical limits;
FlatCake with UCX's default transports (every path, control plane, scale with clients);
FlatCake with ``UCX_TLS=tcp`` (the remote paths); Mooncake DRAM (and scale); Mooncake SSD
offload; LMCache CPU and disk backends. Any byte mismatch or failure ends the run non-zero
(the JSON written so far says where).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import metadata
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from benchmarks.peers.report import markdown, write_section
from benchmarks.peers.workload import Workload
from flatcake_ray.cli.benchkit import load_average, unfit_for_record
from flatcake_ray.config import parse_size

SYSTEMS = ("limits", "flatcake", "flatcake_tcp", "mooncake", "lmcache")
PACKAGES = ("flatcake-ray", "ray", "nixl", "torch", "mooncake-transfer-engine-non-cuda", "lmcache")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__)
    parser.add_argument("--pages", type=int, default=3421, help="pages a request has")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--page-bytes", default="16KiB", help="bytes of one page of one layer")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (medians)")
    parser.add_argument("--clients", default="1,2,4,8", help="clients per node to scale to")
    parser.add_argument("--scale-pages", type=int, default=512, help="pages a scale request has")
    parser.add_argument("--only", default=",".join(SYSTEMS), help="phases to run")
    parser.add_argument("--root", default="/var/tmp/flatcake-peers", help="scratch on the disk")
    parser.add_argument("--json", default="bench_out/peers.json", help="where the JSON goes")
    parser.add_argument("--md", default="bench_out/peers.md", help="where the tables go")
    parser.add_argument("--write-md", help="also replace the bench-peers section of this file")
    return parser.parse_args(argv)


def versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def _lmcache_shape(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        "put": {path: row["put"] for path, row in raw.items()},
        "restore": {path: row["restore"] for path, row in raw.items()},
        "restore_lookup": {
            ("CPU" if path.endswith("DRAM") else "disk"): row["lookup_ms"]
            for path, row in raw.items()
        },
    }


def _merge(dram: dict[str, Any], ssd: dict[str, Any]) -> dict[str, Any]:
    out = dict(dram)
    for op in ("put", "restore"):
        out[op] = {**dram.get(op, {}), **ssd.get(op, {})}
    out["bucket_keys"] = ssd.get("bucket_keys")
    return out


def run_phase(
    name: str, workload: Workload, args: argparse.Namespace, clients: list[int], into: dict
) -> Any:
    root = os.path.join(args.root, name)
    if name == "limits":
        from benchmarks.peers.limits import measure_limits

        return measure_limits(workload, root)
    if name in ("flatcake", "flatcake_tcp"):
        from benchmarks.peers.sys_flatcake import run_flatcake

        full = name == "flatcake"
        tls = None if full else "tcp"
        scale = clients if full else []
        return run_flatcake(workload, root, tls, full, args.scale_pages, scale, into)
    if name == "mooncake":
        from benchmarks.peers.sys_mooncake import run_dram, run_ssd

        return _merge(
            run_dram(workload, root + "-dram", clients, args.scale_pages),
            run_ssd(workload, root + "-ssd"),
        )
    if name == "lmcache":
        from benchmarks.peers.sys_lmcache import run_lmcache

        return _lmcache_shape(run_lmcache(workload, root))
    raise ValueError(f"unknown phase {name!r}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = Workload(args.pages, args.layers, parse_size(args.page_bytes), args.rounds)
    clients = [int(c) for c in args.clients.split(",") if c]
    phases = [p for p in args.only.split(",") if p]
    results: dict[str, Any] = {
        "config": {
            "command": "python -m benchmarks.peers "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "pages": workload.pages,
            "layers": workload.layers,
            "page_bytes": workload.page_bytes,
            "bytes": workload.nbytes,
            "rounds": workload.rounds,
            "scale_pages": args.scale_pages,
            "clients": clients,
            "versions": versions(),
            "load_before": load_average(),
        },
        "phase_seconds": {},
    }
    started, status = time.perf_counter(), 0
    try:
        for phase in phases:
            print(f"[bench-peers] {phase} ...", file=sys.stderr, flush=True)
            begun = time.perf_counter()
            results[phase] = {}
            results[phase] = run_phase(phase, workload, args, clients, results[phase])
            results["phase_seconds"][phase] = round(time.perf_counter() - begun, 1)
    except BaseException as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
        status = 1
        raise
    finally:
        results["config"]["wall_seconds"] = round(time.perf_counter() - started, 1)
        results["config"]["load_after"] = load_average()
        refused = _write(results, args)
    return status or (2 if refused else 0)


def row_limits(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Every row's limits sampled beside it: ``"<column> <op> <path>" -> {name: GB/s}``."""
    rows = {}
    for column in ("flatcake", "flatcake_tcp"):
        for op in ("restore", "put"):
            for path, row in (results.get(column) or {}).get(op, {}).items():
                if row.get("limits"):
                    rows[f"{column} {op} {path}"] = row["limits"]
    return rows


def refusal(results: dict[str, Any]) -> list[str]:
    """Why this run must not be written into BENCHMARKS.md (empty: it may)."""
    config = results["config"]
    return unfit_for_record(config["load_before"], row_limits(results), results.get("limits"))


def _write(results: dict[str, Any], args: argparse.Namespace) -> bool:
    """Write the JSON and the tables; True when ``--write-md`` was refused."""
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(results, fh, indent=2, default=str)
    if "error" in results or "limits" not in results:
        print(
            f"[bench-peers] failed: {results.get('error')}; partial JSON in {args.json}",
            file=sys.stderr,
        )
        return False
    text = markdown(results)
    os.makedirs(os.path.dirname(args.md) or ".", exist_ok=True)
    with open(args.md, "w") as fh:
        fh.write(text)
    print(text)
    if not args.write_md:
        return False
    reasons = refusal(results)
    if reasons:
        print(
            f"[bench-peers] NOT writing {args.write_md}: rerun on a quiet machine.", file=sys.stderr
        )
        for reason in reasons:
            print(f"[bench-peers]   {reason}", file=sys.stderr)
        return True
    write_section(args.write_md, text)
    return False
