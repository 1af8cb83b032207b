"""``flatcake-ray replay --live``: replay a trace against a running service with real bytes,
and the same trace through the model, side by side (``docs/bench_replay.md``).

Requests are dealt to the nodes by session (sessions in order of first arrival, round robin,
so the nodes' loads match); a client on each node (``replay_live_node.py``) replays its
requests on the trace's clock times ``--time-scale``, pages of ``--page-bytes`` a layer.
Without ``--address`` a local ``ray.cluster_utils.Cluster`` of ``--nodes`` nodes is started
(one machine: its "nodes" share a disk and memory bus); with it, the service is started on
that cluster's nodes and each client runs on its node (its addresses are the cluster's).
The model (``replay_live_compare.py``) then replays each node's share with that node's store
config. Writes ``live.json``, ``live.md`` and PNG plots to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from flatcake_ray.config import ServiceConfig, parse_size
from flatcake_ray.errors import ConfigError

NAMESPACE = "flatcake-replay-live"
RESOURCE = "fcreplay"


def add_live_arguments(parser: argparse.ArgumentParser) -> None:
    live = parser.add_argument_group("live (--live: against a running service, with bytes)")
    live.add_argument("--live", action="store_true", help="replay against a live service")
    live.add_argument("--address", help="a running Ray cluster (default: start a local one)")
    live.add_argument("--nodes", type=int, default=2, help="storage nodes (local cluster)")
    live.add_argument("--layers", type=int, default=4)
    live.add_argument("--page-bytes", default="4KiB", help="bytes of a page of one layer")
    live.add_argument("--page-tokens", type=int, help="tokens a page (default: placement's)")
    live.add_argument("--dram-bytes", default="64MiB", help="DRAM arena per node")
    live.add_argument("--ssd-bytes", default="1GiB", help="SSD pool per node")
    live.add_argument("--time-scale", type=float, default=1.0, help="x the trace's gaps")
    live.add_argument("--root", default="/tmp/flatcake-replay-live", help="per-node folders")
    live.add_argument("--chunk", type=int, default=16, help="requests per call to a node")


def service_config(args: argparse.Namespace) -> ServiceConfig:
    ssd = parse_size(args.ssd_bytes)
    files = 2
    file_bytes = -(-max(ssd // files, 8 << 20) // (4 << 20)) * (4 << 20)
    return ServiceConfig(
        namespace=NAMESPACE,
        root=os.path.join(args.root, "{node}"),
        layers=args.layers,
        page_bytes=parse_size(args.page_bytes),
        dram_bytes=-(-parse_size(args.dram_bytes) // (4 << 20)) * (4 << 20),
        ssd_files_per_dir=files,
        ssd_file_bytes=file_bytes,
        hugepages="off",
        fsync=False,
        rpc_timeout_s=60.0,
    )


def nodes_by_session(sessions: np.ndarray, nodes: int) -> np.ndarray:
    """Per request: its node slot. A session's requests share a node; sessions are dealt
    round robin in order of first arrival; a request without a session goes by its index."""
    codes, first = np.unique(sessions, return_index=True)
    rank = np.empty(len(codes), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(codes))
    slot = rank[np.searchsorted(codes, sessions)] % nodes
    loose = sessions < 0
    slot[loose] = np.flatnonzero(loose) % nodes
    return slot


def run_live(args: argparse.Namespace, pages: Any, arrivals: np.ndarray) -> dict[str, Any]:
    """Replay against the service; returns per-request records and each node's store config."""
    import ray

    from flatcake_ray.cli.benchkit import running_service

    config = service_config(args)
    with running_service(config, args.address, args.nodes, RESOURCE, args.root) as targets:
        node_of = nodes_by_session(pages.sessions, len(targets))
        nodes = _node_actors(targets, pages)
        wheres = ray.get([node.where.remote() for node in nodes])
        records = _drive(nodes, node_of, arrivals, args, time.time() + 1.0)
        found = ray.get([node.stats.remote() for node in nodes])
        stats = {w["node_id"]: s for w, s in zip(wheres, found, strict=True)}
        calibration = ray.get([n.calibrate.remote() for n in nodes]) if args.measure else []
    stores = {slot: w["store"] for slot, w in enumerate(wheres)}
    return {
        "records": records,
        "node_of": node_of,
        "stores": stores,
        "stats": stats,
        "calibration": calibration,
    }


def _node_actors(targets: list[str], pages: Any) -> list[Any]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from flatcake_ray.cli.replay_live_node import LiveNode

    actor = ray.remote(LiveNode)
    shared = ray.put(pages)
    return [
        actor.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote(NAMESPACE, shared)
        for node in targets
    ]


def _drive(
    nodes: list[Any],
    node_of: np.ndarray,
    arrivals: np.ndarray,
    args: argparse.Namespace,
    start_at: float,
) -> list[dict[str, Any]]:
    """Feed each node its requests a chunk at a time (one call in flight per node)."""
    import ray

    queues = [np.flatnonzero(node_of == slot) for slot in range(len(nodes))]
    bar = _bar(not args.no_progress, len(node_of))
    records: list[dict[str, Any]] = []
    at = [0] * len(nodes)
    pending: dict[Any, int] = {}

    def submit(slot: int) -> None:
        chunk = queues[slot][at[slot] : at[slot] + args.chunk]
        at[slot] += len(chunk)
        if len(chunk):
            ref = nodes[slot].run.remote(chunk.tolist(), arrivals[chunk].tolist(), start_at)
            pending[ref] = slot

    for slot in range(len(nodes)):
        submit(slot)
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            slot = pending.pop(ready[0])
            submit(slot)
            done = ray.get(ready[0])
            records.extend(done)
            if bar is not None:
                bar.update(len(done))
    finally:
        if bar is not None:
            bar.close()
    return records


def _bar(enabled: bool, total: int) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="live replay")


def live_command(args: argparse.Namespace, trace: Any) -> int:
    from flatcake_ray.cli import replay_live_compare as compare
    from flatcake_ray.replay.pages import build_pages
    from flatcake_ray.replay.profiles import measure_this_machine
    from flatcake_ray.replay.workloads import arrivals_for, as_trace

    if not args.time_scale > 0 or args.nodes < 1:
        raise ConfigError("--time-scale must be > 0 and --nodes >= 1")
    default_tokens = ServiceConfig().store_config("0" * 16, 0).placement.page_tokens
    page_tokens = args.page_tokens or default_tokens
    pages = build_pages(as_trace(trace, args.limit), page_tokens)
    # The trace's clock, ties spread (a burst on one timestamp is a tick's worth of requests).
    arrivals = arrivals_for(pages, None, 0, "spread") * args.time_scale
    load = os.getloadavg()
    started = time.perf_counter()
    live = run_live(args, pages, arrivals)
    wall = time.perf_counter() - started
    changes: dict[str, Any] = {}
    if args.measure:  # O_DIRECT from the drive; the DRAM path and fixed costs from the service
        changes = measure_this_machine()
        for name in ("h2d_gb_s", "restore_overhead_ms"):  # else memcpy's rate stands
            found = [c[name] for c in live["calibration"] if name in c]
            if found:
                changes[name] = float(np.median(found))
    result = compare_and_write(args, pages, arrivals, live, page_tokens, changes)
    result["config"].update(load_average_at_start=load, live_wall_s=round(wall, 1))
    Path(args.out, "live.json").write_text(json.dumps(compare.as_json(result), indent=1))
    print(compare.markdown(result["rows"]), end="")
    print(f"load average at start {load[0]:.2f}; live replay {wall:.0f} s; wrote {args.out}")
    return 0 if result["byte_exact"] else 1


def compare_and_write(
    args: argparse.Namespace,
    pages: Any,
    arrivals: np.ndarray,
    live: dict[str, Any],
    page_tokens: int,
    device_constants: dict[str, Any],
) -> dict[str, Any]:
    """The model's run beside the live one; writes ``live.md`` and plots; returns the result."""
    from flatcake_ray.cli import replay_live_compare as compare

    any_store = next(iter(live["stores"].values()))
    client = {"slot_bytes": any_store.restore_slot_bytes}
    client["prefetch_windows"] = any_store.restore_windows
    changes = {**device_constants, **client, **profile_overrides(args)}
    profile = compare.live_profile(
        args.profile, args.layers, parse_size(args.page_bytes), page_tokens, **changes
    )
    began = began_at(live["records"], arrivals)
    model = compare.predict(pages, began, live["node_of"], live["stores"], profile)
    measured = compare.measured_arrays(live["records"], len(pages))
    rows = compare.comparison(pages, measured, model, profile.page_all_layers_bytes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "live.md").write_text(compare.markdown(rows))
    compare.write_plots(measured, model, out)
    records = live["records"]
    return {
        "config": {
            "requests": len(pages),
            "nodes": len(live["stores"]),
            "time_scale": args.time_scale,
            "page_tokens": page_tokens,
            "profile": profile.to_dict(),
            "device_constants": device_constants,
            "calibration": live["calibration"],
        },
        "rows": rows,
        "byte_exact": all(r.get("byte_exact", True) for r in records),
        "remote_hit_pages": int(measured["remote_pages"].sum()),
        "failures": sum(r.get("failures", 0) for r in records),
        "model_counters": model["counters"],
        "node_stats": live["stats"],
        "records": records,
        "predicted": {
            name: model[name].tolist()
            for name in ("dram_pages", "ssd_pages", "ssd_commands", "restore_s", "ssd_seconds")
        },
        "node_of": live["node_of"].tolist(),
    }


def began_at(records: list[dict[str, Any]], arrivals: np.ndarray) -> np.ndarray:
    """When the live node began each request (its arrival plus its wait in the node's queue):
    the model meets each request then. A loaded node queues requests; a model that met them
    on the trace's clock looked a queued request up while an earlier one still ran, which the
    live node never does (one request at a time), so their DRAM counts parted under load."""
    began = np.array(arrivals, dtype=np.float64)
    for record in records:
        began[record["request"]] += record.get("queued_s", 0.0)
    return began


def profile_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``--profile-json``, then each ``--set FIELD=VALUE``: the profile fields to change."""
    found: dict[str, Any] = {}
    if args.profile_json:
        loaded = json.loads(Path(args.profile_json).read_text())
        if not isinstance(loaded, dict):
            raise ConfigError("--profile-json must hold a JSON object")
        found.update(loaded)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set wants FIELD=VALUE, got {item!r}")
        found[key.strip()] = value.strip()
    return found
