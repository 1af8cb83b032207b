"""Control-plane cost of a restore (lookup + lease, release) against pages and cluster size.

Run: ``.venv/bin/python benchmarks/control_plane.py [--pages 1000,10000,100000]
[--nodes 2,4,8] [--simulated 100] [--repeats 9] [--write-md BENCHMARKS.md]``

- *pages*: on a 2-node local cluster, ``locate(lease=True)`` of one chain, warm (the client's
  location cache knows the owner) and cold (cache dropped: the chain's home is asked), and
  the node's ``lookup`` sent the keys themselves against the packed digests the client now
  sends (one call each, lease released after).
- *nodes*: the same warm and cold costs with 2, 4 and 8 nodes, chains written from every node.
- *simulated*: the client's own ``Locator`` against ``--simulated`` in-process fake nodes (Ray
  object refs as answers, owners placed at random, the writer's home records made by the same
  code): calls per cold lookup (both homes' ``find``, then the owner), against the fan-out to
  every node it replaces. Calls only: fake nodes have no time worth reporting. The cluster
  sizes are ``flatcake-ray bench control``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np

from flatcake_ray.cli.benchkit import bench_service_config, start_local_cluster

NAMESPACE = "flatcake-ctl"
RESOURCE = "ctlbench"
LAYERS, PAGE_BYTES = 1, 1024  # the control plane does not look at bytes: keep the puts small


def keys(name: str, pages: int) -> list[str]:
    return [f"{name}/{i}" for i in range(pages)]


def put_chain(client: Any, name: str, pages: int) -> None:
    from flatcake_ray.core.catalog import PutHints

    kv = np.zeros((LAYERS, pages, PAGE_BYTES), np.uint8)
    hints = PutHints(turn=2, prior_reply_tokens=1, context_tokens=1)  # a short chat: DRAM
    client.put(keys(name, pages), kv, session_id=name, hints=hints)


def locate_costs(client: Any, names: list[str], pages: int, repeats: int) -> dict[str, float]:
    """Median ms and calls of warm and cold ``locate(lease=True)`` over ``names``."""
    out: dict[str, list[float]] = {"warm_ms": [], "warm_calls": [], "cold_ms": [], "cold_calls": []}
    for round_ in range(repeats):
        name = names[round_ % len(names)]
        client.forget_locations()
        for kind in ("cold", "warm"):
            report = client.locate(keys(name, pages), lease=True)
            assert report.pages == pages, (name, report.pages)
            out[f"{kind}_ms"].append(report.control_seconds * 1e3)
            out[f"{kind}_calls"].append(report.actor_calls)
    return {k: statistics.median(v) for k, v in out.items()}


def keys_vs_digests(client: Any, name: str, pages: int, repeats: int) -> tuple[float, float]:
    """Median ms of one node ``lookup`` (then release) sent keys, and sent packed digests."""
    import ray

    from flatcake_ray.client.source import digests_of

    owner = client.locate(keys(name, pages)).node_id
    link = client.nodes.get(owner)
    timings: dict[str, list[float]] = {"keys": [], "digests": []}
    for _ in range(repeats):
        for kind in ("keys", "digests"):
            start = time.perf_counter()
            request = keys(name, pages) if kind == "keys" else digests_of(keys(name, pages), None)
            reply = ray.get(link.handle.lookup.remote(request))
            timings[kind].append((time.perf_counter() - start) * 1e3)
            ray.get(link.handle.release.remote(reply.lease_id, []))
    return statistics.median(timings["keys"]), statistics.median(timings["digests"])


def run_cluster(nodes: int, pages_list: list[int], chains: int, repeats: int) -> dict:
    import ray

    from flatcake_ray.client import deploy
    from flatcake_ray.client.client import FlatCakeClient

    root = tempfile.mkdtemp(prefix="fc-ctl-", dir="/var/tmp")
    cluster = start_local_cluster(nodes, RESOURCE)
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    biggest = max(pages_list) * LAYERS * PAGE_BYTES
    config = bench_service_config(
        NAMESPACE, root, LAYERS, PAGE_BYTES, dram_bytes=chains * biggest + (64 << 20), ssd_bytes=0
    )
    try:
        deploy.start(config, resource=RESOURCE)
        client = FlatCakeClient(NAMESPACE)
        rows = []
        for pages in pages_list:
            names = [f"n{nodes}-p{pages}-c{i}" for i in range(chains)]
            for name in names:
                put_chain(client, name, pages)
            row = locate_costs(client, names, pages, repeats)
            row["keys_ms"], row["digests_ms"] = keys_vs_digests(client, names[0], pages, repeats)
            rows.append({"nodes": nodes, "pages": pages, **row})
        client.close()
        deploy.stop(NAMESPACE)
        return {"rows": rows}
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)


class _Method:
    def __init__(self, answer: Any) -> None:
        self._answer = answer

    def remote(self, *args: Any) -> Any:
        import ray

        return ray.put(self._answer(*args))


class _FakeNode:
    """A node of the simulation: answers ``exists`` for the chains it owns, ``home_of`` and
    ``record_home`` for the chains it is home to (the same calls the real node answers)."""

    def __init__(self, node_id: int, owned: set[bytes]) -> None:
        self.node_id, self.owned, self.homed = node_id, owned, {}
        self.calls = 0
        self.handle = self

    def is_up(self, now: float) -> bool:
        return True

    def __getattr__(self, method: str) -> _Method:
        from flatcake_ray.actors.homes import Found
        from flatcake_ray.core.homes import anchor_of

        def exists(digests: Any) -> int:
            return 8 if anchor_of(digests) in self.owned else 0

        def find(method: str, digests: Any) -> Found:
            found = exists(digests)
            return Found(found, None if found else self.homed.get(anchor_of(digests)))

        answers = {
            "exists": exists,
            "find": find,
            "home_of": lambda first: self.homed.get(first),
            "record_home": lambda first, owner: self.homed.__setitem__(first, owner),
        }
        self.calls += 1
        return _Method(answers[method])


class _FakeTable:
    def __init__(self, links: list[_FakeNode]) -> None:
        self.links = {link.node_id: link for link in links}

    def up(self) -> list[_FakeNode]:
        return list(self.links.values())

    def get(self, node_id: int) -> _FakeNode | None:
        return self.links.get(node_id)

    def refresh(self, **_: Any) -> None:
        pass

    def mark_down(self, link: Any, why: str) -> None:
        raise AssertionError(f"no fake node goes down: {why}")


def simulate(nodes: int, chains: int) -> dict[str, float]:
    """Calls per cold lookup through the client's ``Locator`` over ``nodes`` fake nodes."""
    import ray

    from flatcake_ray.client.locate import Locator
    from flatcake_ray.client.report import RestoreReport
    from flatcake_ray.core.homes import anchor_of
    from flatcake_ray.core.keys import request_digests

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        rng = random.Random(7)
        fakes = [_FakeNode(node_id, set()) for node_id in range(1, nodes + 1)]
        table = _FakeTable(fakes)
        writer = Locator(table, 10.0)  # type: ignore[arg-type]
        digests = [request_digests(keys(f"sim{i}", 8), None) for i in range(chains)]
        for chain in digests:
            owner = rng.choice(fakes)
            owner.owned.add(anchor_of(chain))
            writer.record_home(anchor_of(chain), owner.node_id)
        calls = []
        for chain in digests:
            reader = Locator(table, 10.0)  # type: ignore[arg-type]
            report = RestoreReport(8)
            link, found = reader.ask("exists", chain, report)
            assert link is not None and found == 8 and reader.fanouts == 0
            calls.append(report.actor_calls)
        misses = []
        for i in range(chains):
            reader = Locator(table, 10.0)  # type: ignore[arg-type]
            report = RestoreReport(8)
            link, found = reader.ask("exists", request_digests(keys(f"nil{i}", 8), None), report)
            assert link is None and reader.fanouts == 0
            misses.append(report.actor_calls)
        return {
            "nodes": nodes,
            "mean": statistics.mean(calls),
            "max": max(calls),
            "miss_max": max(misses),
        }
    finally:
        ray.shutdown()


def markdown(results: list[dict], simulated: dict | None, command: str) -> str:
    lines = [
        "<!-- control-plane:start -->",
        f"Command: `{command}`",
        "",
        "| nodes | pages | warm ms (calls) | cold ms (calls) | node `lookup`: keys ms | "
        "packed digests ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        lines.append(
            f"| {row['nodes']} | {row['pages']:,} | {row['warm_ms']:.2f} ({row['warm_calls']:.0f})"
            f" | {row['cold_ms']:.2f} ({row['cold_calls']:.0f}) | {row['keys_ms']:.2f}"
            f" | {row['digests_ms']:.2f} |"
        )
    if simulated is not None:
        lines += [
            "",
            f"Simulated {simulated['nodes']} nodes (the client's `Locator`, fake nodes): "
            f"{simulated['mean']:.2f} calls per cold lookup on average, {simulated['max']} at "
            f"most, against {simulated['nodes']} for asking every node; a miss "
            f"{simulated['miss_max']} calls at most.",
        ]
    lines.append("<!-- control-plane:end -->")
    return "\n".join(lines)


def write_markdown(path: str, section: str) -> None:
    with open(path) as handle:
        text = handle.read()
    start, end = "<!-- control-plane:start -->", "<!-- control-plane:end -->"
    if start in text:
        text = text[: text.index(start)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n## Control plane (`benchmarks/control_plane.py`)\n\n" + section
    with open(path, "w") as handle:
        handle.write(text + ("" if text.endswith("\n") else "\n"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", default="1000,10000,100000")
    parser.add_argument("--nodes", default="2,4,8")
    parser.add_argument("--node-pages", type=int, default=3421, help="pages a chain has (nodes)")
    parser.add_argument("--simulated", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--write-md")
    args = parser.parse_args(argv)
    results = run_cluster(2, [int(p) for p in args.pages.split(",")], 3, args.repeats)["rows"]
    for nodes in (int(n) for n in args.nodes.split(",")):
        results += run_cluster(nodes, [args.node_pages], 2 * nodes, args.repeats)["rows"]
    simulated = simulate(args.simulated, 200) if args.simulated else None
    command = ".venv/bin/python benchmarks/control_plane.py " + " ".join(argv or sys.argv[1:])
    section = markdown(results, simulated, command.strip())
    print(section)
    if args.write_md:
        write_markdown(args.write_md, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
