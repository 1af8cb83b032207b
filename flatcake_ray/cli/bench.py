"""``flatcake-ray bench restore``: restore bandwidth per path, beside its limit, same run.

Two sessions of ``--pages`` pages (default 3,421, a 54K-token context at 16 tokens a page)
are written, one placed in DRAM and one on SSD. For each, a client on the owner's node
restores it (local DRAM, local SSD) and a client on another node does (remote DRAM over NIXL,
remote SSD shipped over NIXL, or NVMe-oF where visible). Beside each, its limit measured in
the same run on the same node: a memcpy of the same bytes (local DRAM), a sequential O_DIRECT
read of the same bytes from the owner's pool files (local SSD), one raw NIXL DRAM-to-DRAM read
of the same bytes (remote DRAM), and the lower of those two for remote SSD (it is both).
Also the control-plane time of a request (lookup + lease, warm and cold location cache) and
its actor calls. ``gbps`` is 1e9 bytes per second. Without ``--address`` it starts a
``ray.cluster_utils.Cluster`` of ``--nodes`` nodes on 127.0.0.1 (one machine: all "nodes"
share its memory bus and disk, so remote paths here measure loopback, not a network).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from flatcake_ray.cli.benchkit import (
    await_prewrite,
    bench_folder,
    bench_service_config,
    best_gbps,
    load_average,
    memcpy_gbps,
    odirect_read_gbps,
    running_service,
    seeded_pages,
    unfit_for_record,
)
from flatcake_ray.config import ServiceConfig, parse_size
from flatcake_ray.core.catalog import PutHints

NAMESPACE = "flatcake-bench"


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="storage nodes (at least 2)")
    parser.add_argument("--pages", type=int, default=3421, help="pages a restored session has")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--page-bytes", default="16KiB", help="bytes of a page of one layer")
    parser.add_argument("--repeats", type=int, default=3, help="timed restores; best is kept")
    parser.add_argument("--address", help="a running Ray cluster (default: start a local one)")
    parser.add_argument(
        "--root",
        default="/tmp/flatcake-bench",
        help="where the run makes its store folders (a fresh folder inside, removed after)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="also time pipelined (per-layer waits) against whole-prefix restores per path",
    )


class RestoreBench:
    """One client on one node; wrapped with ray.remote and pinned to that node."""

    def __init__(self, namespace: str) -> None:
        from flatcake_ray.client.client import FlatCakeClient

        self.client = FlatCakeClient(namespace)

    def await_prewrite(self) -> float:
        return await_prewrite(self.client)

    def where(self) -> dict[str, Any]:
        return {"ray_node_id": self.client.ray_node_id, "node_id": self.client.nodes.local_node_id}

    def put_session(self, name: str, pages: int, medium: str, seed: int) -> dict[str, Any]:
        keys = [f"{name}-{i}" for i in range(pages)]
        # A later turn after a short reply goes to DRAM (the context hint keeps a long
        # session from counting as agentic); a first turn goes to SSD.
        short_chat = PutHints(turn=2, prior_reply_tokens=1, context_tokens=1)
        hints = short_chat if medium == "DRAM" else PutHints(turn=1)
        kv = _kv(self.client, pages, seed)
        result = self.client.put(keys, kv, session_id=name, hints=hints)
        owner = self.client.locate(keys).node_id
        assert result.medium is not None, "the bench's keys were stored already"
        return {"keys": keys, "medium": result.medium.name, "owner": owner}

    def restore(self, keys: list[str], seed: int, repeats: int) -> dict[str, Any]:
        """Whole restores through the client's pipeline, timed end to end (lease, reads,
        checks, scatter into ``out``, release)."""
        out = np.zeros((self.client.layers, len(keys), self.client.page_bytes), dtype=np.uint8)
        runs = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            report = self.client.restore_report(keys, out)
            runs.append((time.perf_counter() - started, report))
        exact = bool(np.array_equal(out, _kv(self.client, len(keys), seed)))
        seconds, best = min(runs[1:], key=lambda run: run[0])  # the first pays for connections
        path, tally = max(best.paths.items(), key=lambda item: item[1].bytes)
        return {
            "transport": path,
            "pages": best.pages,
            "byte_exact": exact and best.pages == len(keys),
            "bytes": out.nbytes,  # delivered; moved_bytes includes read padding
            "moved_bytes": tally.bytes,
            "seconds": seconds,
            "data_seconds": best.data_seconds,
            "io_commands": tally.io_commands,
            "actor_calls": best.actor_calls,
        }

    def overlap(self, keys: list[str], repeats: int) -> dict[str, Any]:
        """The pipelined restore against the whole-prefix one, same bytes, same pipeline: a
        stand-in "attention" of fixed cost per layer (a sleep, sized so compute and I/O take
        about as long) runs after ``wait_for_layer(l)`` (pipelined, as vLLM's
        ``wait_for_layer_load``) or after ``wait()`` (whole prefix, then every layer)."""
        import torch

        from flatcake_ray.restore.dest import PagedPool

        client, layers = self.client, self.client.layers
        out = torch.zeros((layers, len(keys), client.page_bytes), dtype=torch.uint8)
        pool = PagedPool(out, np.arange(len(keys)))
        pipeline = client.pipeline()

        def run(compute_s: float, pipelined: bool) -> float:
            start = time.perf_counter()
            handle = pipeline.submit(keys, pool)
            if not pipelined:
                handle.wait()
            for layer in range(layers):
                if pipelined:
                    handle.wait_for_layer(layer)
                time.sleep(compute_s)
            assert handle.wait() == len(keys)
            return time.perf_counter() - start

        io = statistics.median(run(0.0, True) for _ in range(3))
        compute_s = io / layers
        rows = []
        for _ in range(repeats):  # each of the four back to back, so noise hits all of them
            sample = {"io": run(0.0, True), "serial": run(compute_s, False)}
            sample["pipelined"] = run(compute_s, True)
            sample["compute"] = compute_s * layers
            hidden = sample["io"] + sample["compute"] - sample["pipelined"]
            sample["overlap"] = hidden / min(sample["io"], sample["compute"])
            rows.append(sample)
        median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        return {
            "serial_s": round(median["serial"], 4),
            "pipelined_s": round(median["pipelined"], 4),
            "speedup": round(median["serial"] / median["pipelined"], 3),
            "overlap": round(median["overlap"], 3),
            "window_bytes": pipeline.window_bytes,
            "high_water_bytes": pipeline.high_water_bytes,
        }

    def high_water(self, keys: list[str], slot_bytes: int) -> int:
        """The most staging memory a fresh pipeline held restoring ``keys`` once."""
        from flatcake_ray.restore.pipeline import RestorePipeline

        out = np.zeros((self.client.layers, len(keys), self.client.page_bytes), dtype=np.uint8)
        with RestorePipeline(self.client.source, slot_bytes=slot_bytes) as pipeline:
            assert pipeline.submit(keys, out, np.arange(len(keys))).wait() == len(keys)
            return pipeline.high_water_bytes

    def control(self, keys: list[str], repeats: int) -> dict[str, Any]:
        """Lookup + lease + release of a request, no data: cold and warm location cache."""
        cold, warm = [], []
        for _ in range(repeats):
            self.client.forget_locations()
            cold.append(self.client.locate(keys, lease=True))  # asks the chain's homes
            warm.append(self.client.locate(keys, lease=True))  # asks the one that has it
        return {
            "pages": len(keys),
            "warm_seconds": statistics.median(r.control_seconds for r in warm),
            "cold_seconds": statistics.median(r.control_seconds for r in cold),
            "warm_actor_calls": int(statistics.median(r.actor_calls for r in warm)),
            "cold_actor_calls": int(statistics.median(r.actor_calls for r in cold)),
        }

    def memcpy_limit(self, nbytes: int, repeats: int) -> float:
        return memcpy_gbps(nbytes, repeats)

    def odirect_limit(self, nbytes: int, repeats: int) -> float:
        """Sequential O_DIRECT reads of this node's pool files, 32 MiB a command."""
        link = self.client.nodes.require(self.client.nodes.local_node_id)
        paths, file_bytes = link.description.pool_paths, link.description.pool_file_bytes
        return odirect_read_gbps(paths, file_bytes, nbytes, repeats)

    def nixl_limit(self, owner: int, nbytes: int, repeats: int) -> float:
        """One raw NIXL READ of ``nbytes`` from the owner's arena (one descriptor)."""
        from flatcake_ray.core.gva import Medium
        from flatcake_ray.transports.base import REMOTE_DRAM_NIXL, ReadBatch

        link = self.client.nodes.require(owner)
        transport, lock = link.transport(REMOTE_DRAM_NIXL, Medium.DRAM, self.client._nixl_agent)
        dst = np.empty(nbytes, dtype=np.uint8)
        batch = ReadBatch([0], [nbytes], [0])
        with lock:
            transport.read(batch, dst)  # registration and connection, untimed
            return best_gbps(nbytes, repeats, lambda: transport.read(batch, dst))


def _kv(client: Any, pages: int, seed: int) -> np.ndarray:
    return seeded_pages(client.layers, pages, client.page_bytes, seed)


def _row(measured: dict[str, Any], limit_gbps: float) -> dict[str, Any]:
    gbps = measured["bytes"] / measured["seconds"] / 1e9
    return {
        **measured,
        "gbps": round(gbps, 3),
        "limit_gbps": round(limit_gbps, 3),
        "ratio_to_limit": round(gbps / limit_gbps, 3) if limit_gbps else None,
    }


# ---- orchestration ---------------------------------------------------------------------------
def _service_config(args: argparse.Namespace, root: str, session_bytes: int) -> ServiceConfig:
    file_bytes = -(-(session_bytes + (8 << 20)) // (4 << 20)) * (4 << 20)
    page_bytes = parse_size(args.page_bytes)
    return bench_service_config(
        NAMESPACE,
        root,
        args.layers,
        page_bytes,
        dram_bytes=2 * file_bytes,
        ssd_bytes=2 * file_bytes,
        files=2,
        request_bytes=session_bytes,
    )


def _bench_actors(ray_nodes: list[str]) -> list[Any]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(RestoreBench)
    return [
        actor.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote(NAMESPACE)
        for node in ray_nodes
    ]


def _measure(benches: list[Any], by_node: dict[int, Any], args: argparse.Namespace) -> dict:
    import ray

    sessions = {
        "DRAM": ray.get(benches[0].put_session.remote("bench-dram", args.pages, "DRAM", 1)),
        "SSD": ray.get(benches[0].put_session.remote("bench-ssd", args.pages, "SSD", 2)),
    }
    nbytes = args.layers * args.pages * parse_size(args.page_bytes)
    results: dict[str, Any] = {}
    for medium, seed in (("DRAM", 1), ("SSD", 2)):
        session = sessions[medium]
        owner = by_node[session["owner"]]
        other = next(b for node_id, b in by_node.items() if node_id != session["owner"])
        local = ray.get(owner.restore.remote(session["keys"], seed, args.repeats))
        remote = ray.get(other.restore.remote(session["keys"], seed, args.repeats))
        if args.overlap:
            local["pipelined"] = ray.get(owner.overlap.remote(session["keys"], args.repeats))
            remote["pipelined"] = ray.get(other.overlap.remote(session["keys"], args.repeats))
        if medium == "DRAM":
            memcpy = ray.get(owner.memcpy_limit.remote(nbytes, args.repeats))
            nixl = ray.get(other.nixl_limit.remote(session["owner"], nbytes, args.repeats))
            results["local_dram"] = _row(local, memcpy)
            results["remote_dram"] = _row(remote, nixl)
        else:
            odirect = ray.get(owner.odirect_limit.remote(nbytes, args.repeats))
            results["local_ssd"] = _row(local, odirect)
            results["remote_ssd"] = _row(remote, min(odirect, nixl))
            results["remote_ssd"]["serial_limit_gbps"] = round(1 / (1 / odirect + 1 / nixl), 3)
        results.setdefault("_placed", {})[medium] = session["medium"]
    results["control_plane"] = ray.get(benches[-1].control.remote(sessions["DRAM"]["keys"], 5))
    if args.overlap:  # staging held by a short and by the long context: the same bound
        keys, slot = sessions["SSD"]["keys"], 1 << 20
        short = ray.get(benches[-1].high_water.remote(keys[: max(1, len(keys) // 16)], slot))
        full = ray.get(benches[-1].high_water.remote(keys, slot))
        results["window"] = {"slot_bytes": slot, "short_high_water": short, "long_high_water": full}
    return results


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    if args.nodes < 2:
        raise ValueError("--nodes must be at least 2 (a remote path needs a second node)")
    session_bytes = args.layers * args.pages * parse_size(args.page_bytes)
    root = bench_folder(args.root, "run-")
    config = _service_config(args, root, session_bytes)
    started, load_before = time.perf_counter(), load_average()
    with running_service(config, args.address, args.nodes, "fcbench", root) as targets:
        benches = _bench_actors(targets)
        wheres = ray.get([b.where.remote() for b in benches])
        by_node = {w["node_id"]: b for w, b in zip(wheres, benches, strict=True)}
        prewrite_s = ray.get(benches[0].await_prewrite.remote())
        results = _measure(benches, by_node, args)
    placed = results.pop("_placed")
    return {
        "config": {
            "nodes": args.nodes,
            "pages": args.pages,
            "layers": args.layers,
            "page_bytes": parse_size(args.page_bytes),
            "bytes_per_restore": session_bytes,
            "repeats": args.repeats,
            "placed": placed,
            "units": "gbps = 1e9 bytes/s; seconds = best of repeats, lookup to last byte",
            "wall_seconds": round(time.perf_counter() - started, 1),
            "load_before": load_before,
            "load_after": load_average(),
            "prewrite_seconds": round(prewrite_s, 2),  # pools written once before timing
        },
        "paths": {k: v for k, v in results.items() if k not in ("control_plane", "window")},
        "control_plane": results["control_plane"],
        "window": results.get("window"),
    }


def format_results(results: dict[str, Any]) -> str:
    lines = [
        f"{'path':<12} {'transport':<20} {'GB/s':>7} {'limit':>7} {'ratio':>6} "
        f"{'io cmds':>8} {'calls':>5}  exact"
    ]
    for name, row in results["paths"].items():
        lines.append(
            f"{name:<12} {row['transport']:<20} {row['gbps']:>7.3f} {row['limit_gbps']:>7.3f} "
            f"{row['ratio_to_limit']:>6.2f} {row['io_commands']:>8} {row['actor_calls']:>5}  "
            f"{row['byte_exact']}"
        )
    for name, row in results["paths"].items():
        if "pipelined" in row:
            pipe = row["pipelined"]
            lines.append(
                f"{name:<12} pipelined {pipe['pipelined_s']:.3f} s vs whole-prefix "
                f"{pipe['serial_s']:.3f} s: speedup {pipe['speedup']:.2f}, "
                f"overlap {pipe['overlap']:.2f}"
            )
    if results.get("window"):
        window = results["window"]
        lines.append(
            f"staging high-water with {window['slot_bytes'] >> 20} MiB slots: "
            f"{window['short_high_water'] >> 20} MiB (1/16 of the context), "
            f"{window['long_high_water'] >> 20} MiB (all of it)"
        )
    config = results["config"]
    lines.append(f"load average {config['load_before']} before, {config['load_after']} after")
    reasons = refusal(results)
    verdict = "yes" if not reasons else "no: " + "; ".join(reasons)
    lines.append(f"fit for BENCHMARKS.md: {verdict}")
    control = results["control_plane"]
    lines.append(
        f"control plane, {control['pages']}-page request: "
        f"{control['warm_seconds'] * 1e3:.2f} ms / {control['warm_actor_calls']} calls (warm), "
        f"{control['cold_seconds'] * 1e3:.2f} ms / {control['cold_actor_calls']} calls (cold)"
    )
    return "\n".join(lines)


LIMIT_NAMES = {"local_dram": "memcpy", "remote_dram": "nixl", "local_ssd": "odirect_read"}


def refusal(results: dict[str, Any]) -> list[str]:
    """Why these figures must not be recorded (``benchkit.unfit_for_record``); empty: fit."""
    rows = {
        path: {LIMIT_NAMES[path]: row["limit_gbps"]}
        for path, row in results["paths"].items()
        if path in LIMIT_NAMES
    }
    return unfit_for_record(results["config"]["load_before"], rows)


def run_from_args(args: argparse.Namespace) -> int:
    results = run_bench(args)
    print(json.dumps(results, indent=2) if args.json else format_results(results))
    return 0 if all(row["byte_exact"] for row in results["paths"].values()) else 1
