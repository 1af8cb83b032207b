"""``flatcake-ray bench control``: what a lookup costs as the cluster grows.

For each size in ``--nodes`` a ``ray.cluster_utils.Cluster`` is started on 127.0.0.1: a head
with no storage node (the bench's client runs there, so placement spreads the chains over
every node rather than keeping them on the writer's) and one storage node per worker node
(``num_cpus=0``). ``--chains`` chains of ``--pages`` pages are stored; then
``locate(lease=True)`` (the control half of a restore: key checks and hashing, the lookup with
lease, the release) is timed and counted for ``--lookups`` prefixes no node holds (misses)
and ``--lookups`` stored ones (hits), each with a cold location cache (a client that never
saw the chain: its homes are asked) and warm (asked again). ``nodes asked`` and ``calls`` are
``RestoreReport.nodes_asked`` and ``actor_calls``; ``fanouts`` counts recoveries that asked
every node (0 on the miss path). The coordinator's messages per second (registrations,
capacity reports and placements it received, from its counters) are measured over the lookup
phase (at least three report intervals): lookups never reach it.

Each size also times an empty actor call to a storage node, interleaved with the lookups:
every "node" here shares the machine's cores, so a bigger cluster loads the machine that
measures it; a lookup's cost in empty calls of the same moment is what carries over.

``stages`` breaks one warm lookup of the first size down: hashing the keys on the client
(and, beside it, hashlib one key at a time: the fallback, and the only path before
``core/_digests.c``), an empty actor call (Ray's floor), the ``lookup`` call alone,
``locate`` end to end (one call: its release rides on the next lookup), and beside it the
same with a release call of its own (the shape before ``Locator.let_go``); ``capacity``
how many empty calls and ``find`` misses one node answers per second with 16 in flight (the
per-call costs ``docs/scaling.md`` builds on).

All on one machine: every "node" shares its cores, so absolute times are the machine's load;
the counts and the ratio of 16 nodes to 2 are what carry over.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from hashlib import blake2b
from typing import Any

import numpy as np

from flatcake_ray.cli.benchkit import (
    bench_folder,
    bench_service_config,
    start_local_cluster,
)
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.keys import DEFAULT_NAMESPACE, namespace_frame

NAMESPACE = "flatcake-bench-control"
RESOURCE = "fcctl"
LAYERS, PAGE_BYTES = 1, 1024  # the control plane never looks at bytes: keep the puts small
SHORT_CHAT = PutHints(turn=2, prior_reply_tokens=1, context_tokens=1)  # DRAM


def add_control_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", default="2,4,8,16", help="cluster sizes, comma separated")
    parser.add_argument("--pages", type=int, default=3421, help="pages a chain has")
    parser.add_argument("--chains", type=int, default=20, help="chains stored")
    parser.add_argument("--lookups", type=int, default=50, help="misses and hits timed")
    parser.add_argument(
        "--root",
        default=None,
        help="where each size makes its store folders (a fresh one inside, removed after)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def chain_keys(name: str, pages: int) -> list[str]:
    return [f"{name}/{i}" for i in range(pages)]


def _start(nodes: int, tries: int = 3) -> Any:
    """The cluster, started again (up to ``tries`` times) when a raylet misses Ray's fixed
    30 s startup wait, as it may on a loaded machine."""
    for _ in range(tries - 1):
        try:
            return start_local_cluster(nodes, RESOURCE, on_head=False, node_cpus=0)
        except Exception as exc:
            if "timed out during startup" not in str(exc):
                raise
    return start_local_cluster(nodes, RESOURCE, on_head=False, node_cpus=0)


def _coordinator_messages(namespace: str) -> int:
    import ray

    from flatcake_ray.actors.protocol import COORDINATOR_NAME
    from flatcake_ray.client.deploy import operator_secret

    coordinator = ray.get_actor(COORDINATOR_NAME, namespace=namespace)
    ref: Any = coordinator.info.remote(operator_secret(namespace))
    info: dict[str, Any] = ray.get(ref, timeout=60)
    return sum(int(info[k]) for k in ("registrations", "reports", "placements"))


def _timed(client: Any, keys: list[str], forget: bool) -> tuple[float, Any]:
    if forget:
        client.forget_locations()
    started = time.perf_counter()
    report = client.locate(keys, lease=True)
    return (time.perf_counter() - started) * 1e3, report


def _empty_call(client: Any, i: int) -> float:
    """Ms of one actor call that does nothing, to a node chosen by ``i``: this machine's cost
    of a Ray round trip at this moment, to read the lookups against."""
    import ray

    links = sorted(client.nodes.up(), key=lambda link: link.node_id)
    started = time.perf_counter()
    ray.get(links[i % len(links)].handle.actor.ping.remote())
    return (time.perf_counter() - started) * 1e3


def _lookups(client: Any, args: argparse.Namespace, stored: list[str]) -> dict[str, Any]:
    """Misses and hits, cold then warm, interleaved with empty calls so load drifts hit every
    kind alike."""
    samples: dict[str, list[tuple[float, Any]]] = {}
    empty = []
    for i in range(args.lookups):
        empty.append(_empty_call(client, i))
        miss = chain_keys(f"absent-{i}", args.pages)
        hit = chain_keys(stored[i % len(stored)], args.pages)
        for kind, keys in (("miss", miss), ("hit", hit)):
            samples.setdefault(f"{kind}_cold", []).append(_timed(client, keys, True))
            samples.setdefault(f"{kind}_warm", []).append(_timed(client, keys, False))
    out: dict[str, Any] = {}
    for name, rows in samples.items():
        expect = args.pages if name.startswith("hit") else 0
        out[name] = {
            # Lookups that did not find what is stored (a node that missed the RPC timeout
            # is marked down: its chains miss) and the node failures reported: 0 and 0.
            "unexpected": sum(report.pages != expect for _, report in rows),
            "failures": sum(len(report.failures) for _, report in rows),
            "ms": round(statistics.median(ms for ms, _ in rows), 3),
            "nodes_asked": round(statistics.mean(r.nodes_asked for _, r in rows), 2),
            "max_nodes_asked": max(r.nodes_asked for _, r in rows),
            "calls": round(statistics.mean(r.actor_calls for _, r in rows), 2),
        }
    out["empty_call_ms"] = round(statistics.median(empty), 3)
    return out


def hashlib_digests(keys: list[str]) -> bytes:
    """The keys' digests one hashlib object at a time: ``core/keys.py``'s fallback where
    ``core/_digests.c`` is not built (and the only path before it), timed beside it."""
    prefix = namespace_frame(DEFAULT_NAMESPACE) + b"s"
    return b"".join([blake2b(prefix + key.encode(), digest_size=16).digest() for key in keys])


def two_calls(link: Any, keys: list[str]) -> None:
    """A warm ``locate(lease=True)`` as it was before ``Locator.let_go``: hash, ``lookup``,
    then a ``release`` call of its own (not awaited), timed beside today's one call."""
    import ray

    from flatcake_ray.client.source import digests_of

    reply = ray.get(link.handle.lookup.remote(digests_of(keys, None)))
    link.handle.release.remote(reply.lease_id, [])


def stages(client: Any, keys: list[str], repeats: int = 30) -> dict[str, float]:
    """Median ms of each stage of one warm ``locate(lease=True)`` of ``keys``."""
    import ray

    from flatcake_ray.client.source import digests_of

    owner = client.locate(keys, lease=True).node_id
    link = client.nodes.require(owner)
    digests = digests_of(keys, None)
    timings: dict[str, list[float]] = {}

    def clock(name: str, work: Any) -> Any:
        started = time.perf_counter()
        value = work()
        timings.setdefault(name, []).append((time.perf_counter() - started) * 1e3)
        return value

    for _ in range(repeats):
        clock("hash_keys", lambda: digests_of(keys, None))
        clock("hash_keys_hashlib", lambda: hashlib_digests(keys))
        clock("empty_call", lambda: ray.get(link.handle.actor.ping.remote()))
        reply = clock("lookup_call", lambda: ray.get(link.handle.lookup.remote(digests)))
        ray.get(link.handle.release.remote(reply.lease_id, []))
        clock("locate_warm", lambda: client.locate(keys, lease=True))
        clock("locate_warm_release_call", lambda: two_calls(link, keys))
    return {name: round(statistics.median(values), 3) for name, values in timings.items()}


def capacity(client: Any, pages: int, seconds: float = 3.0, in_flight: int = 16) -> dict:
    """Calls per second one node answers, ``in_flight`` at a time for ``seconds``: empty
    calls, and ``find`` misses of a ``pages``-page request (what a home does most). A lower
    bound: the caller shares the machine's cores with it."""
    import ray

    from flatcake_ray.client.source import digests_of

    link = min(client.nodes.up(), key=lambda link: link.node_id)
    digests = digests_of(chain_keys("capacity-absent", pages), None)
    calls = {
        "empty_calls_per_s": lambda: link.handle.actor.ping.remote(),
        "find_misses_per_s": lambda: link.handle.find.remote("lookup", digests),
    }
    out = {}
    for name, call in calls.items():
        pending = [call() for _ in range(in_flight)]
        done, started = 0, time.monotonic()
        while time.monotonic() - started < seconds:
            ready, pending = ray.wait(pending, num_returns=1)
            ray.get(ready)
            done += 1
            pending.append(call())
        ray.get(pending)
        out[name] = round(done / (time.monotonic() - started), 1)
    return out


def run_size(nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from flatcake_ray.client import deploy
    from flatcake_ray.client.client import FlatCakeClient

    root = bench_folder(args.root, "fc-bench-control-")
    chain_bytes = args.pages * LAYERS * PAGE_BYTES
    dram = 3 * args.chains * chain_bytes // nodes + (16 << 20)
    config = bench_service_config(NAMESPACE, root, LAYERS, PAGE_BYTES, dram_bytes=dram, ssd_bytes=0)
    cluster = _start(nodes)
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        deploy.start(config, resource=RESOURCE)
        with FlatCakeClient(NAMESPACE) as writer:
            stored = [f"chain-{i}" for i in range(args.chains)]
            kv = np.zeros((LAYERS, args.pages, PAGE_BYTES), np.uint8)
            for name in stored:
                writer.put(chain_keys(name, args.pages), kv, session_id=name, hints=SHORT_CHAT)
        with FlatCakeClient(NAMESPACE) as client:  # a new client: it never saw a chain
            messages, started = _coordinator_messages(NAMESPACE), time.monotonic()
            row = _lookups(client, args, stored)
            # At least a few report intervals, so every node's reports are in the rate.
            time.sleep(max(0.0, 3 * config.report_interval_s - (time.monotonic() - started)))
            elapsed = time.monotonic() - started
            messages = _coordinator_messages(NAMESPACE) - messages
            row["fanouts"] = client.stats(nodes=False)["client"]["fanouts"]
            if nodes == min(int(n) for n in str(args.nodes).split(",")):
                row["stages"] = stages(client, chain_keys(stored[0], args.pages))
                row["capacity"] = capacity(client, args.pages)
        row.update(nodes=nodes, coordinator_msgs_per_s=round(messages / elapsed, 2))
        deploy.stop(NAMESPACE)
        return row
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def run_control(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(n) for n in str(args.nodes).split(",")]
    if min(sizes) < 2:
        raise ValueError("--nodes sizes must be at least 2")
    load_before = os.getloadavg()[0]
    rows = []
    for nodes in sizes:  # each size's row on stderr as it ends: a later size may not start
        rows.append(run_size(nodes, args))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {
        "config": {
            "pages": args.pages,
            "chains": args.chains,
            "lookups": args.lookups,
            "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2),
        },
        "rows": rows,
    }


def format_control(results: dict[str, Any]) -> str:
    config, rows = results["config"], results["rows"]
    lines = [
        f"{config['pages']}-page lookups with lease, {config['lookups']} misses and hits per "
        f"size; load average {config['load_before']} before, {config['load_after']} after",
        "| nodes | miss: nodes asked (max) | miss cold ms | miss warm ms | hit cold: nodes "
        "asked (max) | hit cold ms | hit warm: calls | hit warm ms | empty call ms | miss / "
        "empty call | fan-outs | coordinator msgs/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        mc, mw, hc, hw = (row[k] for k in ("miss_cold", "miss_warm", "hit_cold", "hit_warm"))
        lines.append(
            f"| {row['nodes']} | {mc['nodes_asked']:.2f} ({mc['max_nodes_asked']}) | "
            f"{mc['ms']:.2f} | {mw['ms']:.2f} | {hc['nodes_asked']:.2f} "
            f"({hc['max_nodes_asked']}) | {hc['ms']:.2f} | {hw['calls']:.2f} | {hw['ms']:.2f} | "
            f"{row['empty_call_ms']:.2f} | {mc['ms'] / row['empty_call_ms']:.2f} | "
            f"{row['fanouts']} | {row['coordinator_msgs_per_s']:.2f} |"
        )
        wrong = sum(row[kind]["unexpected"] for kind in ("miss_cold", "miss_warm", "hit_cold"))
        wrong += row["hit_warm"]["unexpected"]
        if wrong:
            lines.append(f"| {row['nodes']}: {wrong} lookups did not find what is stored |")
    first, last = rows[0], rows[-1]
    relative = (last["miss_cold"]["ms"] / last["empty_call_ms"]) / (
        first["miss_cold"]["ms"] / first["empty_call_ms"]
    )
    lines.append(
        f"miss latency, {last['nodes']} nodes / {first['nodes']} nodes: "
        f"{last['miss_cold']['ms'] / first['miss_cold']['ms']:.2f}x in ms, {relative:.2f}x in "
        "empty calls of the same moment"
    )
    lines.append(f"stages of a warm lookup at {first['nodes']} nodes (ms): {first['stages']}")
    lines.append(f"one node's capacity (calls/s, 16 in flight): {first.get('capacity')}")
    return "\n".join(lines)


def cmd_bench_control(args: argparse.Namespace) -> int:
    results = run_control(args)
    print(json.dumps(results, indent=2) if args.json else format_control(results))
    return 0
