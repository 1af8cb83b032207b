"""FlatCake-Ray on a local 2-node Ray cluster (127.0.0.1), driven through its public API only.

Paths come from placement, not from internals: a session is *seeded* with one page (the
coordinator places its scope on some node, the owner), then a client on the owner's node
(local) or on the other node (remote) puts the session's pages with the same ``session_id``,
so they join the owner's scope. After each put the harness asks ``locate`` where the pages
are and labels the row by where they really landed, so a change of placement policy shows up
as a relabelled row, never as a wrong one. DRAM or SSD is chosen with the put's hints.
"""

from __future__ import annotations

import os
import shutil
from collections import defaultdict
from typing import Any

from benchmarks.peers.flatcake_worker import FlatCakeWorker
from benchmarks.peers.workload import Workload, aggregate, gbps, median, start_gate
from flatcake_ray.cli.benchkit import bench_service_config, start_local_cluster

NAMESPACE = "flatcake-peers"
RESOURCE = "peersbench"


class FlatCakeBench:
    """The cluster, the service and the workers of one pass (one UCX setting)."""

    worker_class: type = FlatCakeWorker  # benchmarks/stages_ray.py times stages in a subclass

    def __init__(self, workload: Workload, root: str, scale_pages: int) -> None:
        self.workload, self.root, self.scale_pages = workload, root, scale_pages
        self.cluster: Any = None
        self.workers: dict[int, list[Any]] = defaultdict(list)  # FlatCake node id -> actors
        self.prewrite_s = 0.0  # until the nodes' SSD pools were written once
        self.ray_nodes: dict[int, str] = {}

    def __enter__(self) -> FlatCakeBench:
        import ray

        from flatcake_ray.client import deploy

        self.cluster = start_local_cluster(2, RESOURCE)
        ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False)
        session = self.workload.nbytes
        scale = 8 * 2 * self.scale_pages * self.workload.object_bytes
        config = bench_service_config(
            NAMESPACE, self.root, self.workload.layers, self.workload.page_bytes,
            dram_bytes=max(5 * session, 2 * scale) + (64 << 20),
            ssd_bytes=5 * session + (64 << 20), request_bytes=session,
        )  # fmt: skip
        deploy.start(config, resource=RESOURCE)
        for ray_node in deploy.service_nodes(RESOURCE):
            self._add_worker(ray_node)
        # every node's pool written once, as a deployed node's is soon after its first start
        self.prewrite_s = ray.get(next(iter(self.workers.values()))[0].await_prewrite.remote())
        return self

    def _add_worker(self, ray_node: str) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = (
            ray.remote(self.worker_class)
            .options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node, False)
            )
            .remote(NAMESPACE, self.workload)
        )
        node_id = ray.get(actor.node.remote())
        self.workers[node_id].append(actor)
        self.ray_nodes[node_id] = ray_node
        return actor

    def __exit__(self, *exc: object) -> None:
        import ray

        from flatcake_ray.client import deploy

        try:
            if ray.is_initialized():
                deploy.stop(NAMESPACE)
        finally:
            ray.shutdown()
            if self.cluster is not None:
                self.cluster.shutdown()
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- helpers ------------------------------------------------------------------------
    def first(self, node_id: int) -> Any:
        return self.workers[node_id][0]

    def other(self, node_id: int) -> int:
        return next(n for n in self.workers if n != node_id)

    def seeded(self, session: str, medium: str) -> int:
        import ray

        any_worker = next(iter(self.workers.values()))[0]
        return ray.get(any_worker.seed.remote(session, medium))

    # ---- measurements -------------------------------------------------------------------
    def put_round(self, tag: str, local_writers: bool) -> dict[tuple[str, str], dict]:
        """One put per (medium, writer side) into freshly seeded sessions."""
        import ray

        rows = {}
        for medium in ("DRAM", "SSD"):
            for side in ("local", "remote") if local_writers else ("remote",):
                session = f"{medium.lower()}-{side}-{tag}"
                owner = self.seeded(session, medium)
                writer = self.first(owner if side == "local" else self.other(owner))
                put = ray.get(writer.put.remote(session, self.workload.pages, medium))
                put["session"], put["owner"] = session, owner
                rows[(medium, side)] = put
        return rows

    def beside(self, op: str, medium: str) -> dict[str, float]:
        """The in-process limit of a (op, medium) row, sampled now, right beside it."""
        from benchmarks.peers.limits import local_limits

        name = "memcpy" if medium == "DRAM" else f"odirect_{'read' if op == 'restore' else 'write'}"
        return local_limits(self.workload, os.path.join(self.root, "limits"), (name,))

    def timed_puts(self, local_writers: bool) -> dict[str, Any]:
        runs, near = [], {}
        for r in range(self.workload.rounds):
            for medium in ("DRAM", "SSD"):  # sampled between the rounds they bound
                for name, value in self.beside("put", medium).items():
                    near.setdefault(name, []).append(value)
            runs.append(self.put_round(str(r + 1), local_writers))
        out: dict[str, Any] = {}
        for key in runs[0]:
            samples = [run[key] for run in runs]
            label = put_label(key[0], samples)
            out[label] = {
                "gbps": gbps(samples[0]["bytes"], median([s["seconds"] for s in samples])),
                # each round's, for the spread (a first write into a chunk a client never
                # mapped pays its page tables: one slow round in three is not the median)
                "rounds_gbps": [gbps(s["bytes"], s["seconds"]) for s in samples],
                "medium": sorted({str(s["medium"]) for s in samples}),
                "asked": f"{key[1]} {key[0]}",
                "limits": {name: max(values) for name, values in near.items()},
            }
        return out

    def restores(self, warm: dict, local_readers: bool) -> dict[str, Any]:
        import ray

        out = {}
        for medium in ("DRAM", "SSD"):
            put = warm[(medium, "local")] if (medium, "local") in warm else warm[(medium, "remote")]
            owner = put["owner"]
            sides = {"local": owner, "remote": self.other(owner)}
            for side, node in sides.items():
                if side == "local" and not local_readers:
                    continue
                before = self.beside("restore", medium)
                got = ray.get(self.first(node).restore.remote(put["session"], self.workload.pages))
                after = self.beside("restore", medium)
                out[f"{side} {medium}"] = {
                    "gbps": gbps(got["bytes"], got["seconds"]),
                    "rounds_gbps": [gbps(got["bytes"], seconds) for seconds in got["rounds_s"]],
                    "served_by": got["paths"],
                    "medium": str(put["medium"]),
                    "limits": {name: max(before[name], after[name]) for name in before},
                }
        return out

    def control(self, warm: dict) -> dict[str, Any]:
        import ray

        put = warm[("DRAM", "local")]
        pages = self.workload.pages
        # The owner on another node (every call a Ray call), and on the reader's own machine
        # (its calls to that node direct, client/direct.py): what a serving engine asks most.
        # One after the other: run at once, the two clients' lookups queued at the same
        # owner and shared the two cores, and each measured the other's too.
        remote = ray.get(self.first(self.other(put["owner"])).control.remote(put["session"], pages))
        local = ray.get(self.first(put["owner"]).control.remote(put["session"], pages))
        return {**remote, "local": local}

    def scale(self, clients: list[int], out: dict[int, Any]) -> dict[int, dict[str, Any]]:
        """Aggregate restore and put rates with ``k`` concurrent clients on each node."""
        import ray

        pages = self.scale_pages
        for k in clients:
            for node_id, ray_node in list(self.ray_nodes.items()):
                while len(self.workers[node_id]) < k:
                    self._add_worker(ray_node)
            team = [w for node_id in self.workers for w in self.workers[node_id][:k]]
            # A fresh source each k: the puts of the previous k may have reclaimed the last.
            source = f"scale-src-{k}"
            owner = self.seeded(source, "DRAM")
            ray.get(self.first(owner).put.remote(source, pages, "DRAM"))
            ray.get([w.prepare.remote(source, pages) for w in team])
            ray.get([w.restore_once.remote(source, pages) for w in team])  # warm-up
            restore = []
            for _ in range(self.workload.rounds):
                at = start_gate(len(team))
                calls = [w.restore_once.remote(source, pages, at, False) for w in team]
                restore.append(aggregate(ray.get(calls)))
                ray.get([w.check_restored.remote(source, pages) for w in team])
            puts = []
            for r in range(-1, self.workload.rounds):  # round -1: new clients' first puts
                sessions = [f"scale-{k}-{r}-{i}" for i in range(len(team))]
                ray.get([w.prepare.remote(s, pages) for w, s in zip(team, sessions, strict=True)])
                at = start_gate(len(team))
                refs = [
                    w.put.remote(s, pages, "DRAM", at) for w, s in zip(team, sessions, strict=True)
                ]
                runs = ray.get(refs)
                if r >= 0:
                    puts.append((aggregate(runs), sum(run["local"] for run in runs) / len(runs)))
            out[k] = {
                "restore_gbps": median(restore),
                "put_gbps": median([p[0] for p in puts]),
                "put_local_share": median([p[1] for p in puts]),
                "clients": len(team),
            }
        return out


def put_label(medium: str, samples: list[dict[str, Any]]) -> str:
    """Where the pages really went: ``local``/``remote`` by owner, medium by the put's."""
    local = {s["local"] for s in samples}
    side = "local" if local == {True} else "remote" if local == {False} else "mixed"
    return f"{side} {medium}"


def run_flatcake(
    workload: Workload,
    root: str,
    ucx_tls: str | None,
    full: bool,
    scale_pages: int,
    clients: list[int],
    result: dict[str, Any],
) -> dict[str, Any]:
    """One pass: every path with ``full``, else only the remote ones (the TCP column).
    Fills ``result`` as it goes (a failure keeps what was measured before it)."""
    from benchmarks.peers.limits import environment

    with (
        environment(UCX_TLS=ucx_tls, PYTHONPATH=_pythonpath()),
        FlatCakeBench(workload, root, scale_pages) as bench,
    ):
        result["prewrite_s"] = round(bench.prewrite_s, 2)
        warm = bench.put_round("0", local_writers=full)  # warm-up; restored below
        result["restore"] = bench.restores(warm, local_readers=full)
        if full:
            result["control"] = bench.control(warm)
        result["put"] = bench.timed_puts(local_writers=full)
        if full and clients:
            bench.scale(clients, result.setdefault("scale", {}))
    return result


def _pythonpath() -> str:
    """The repository root first, so Ray's workers import ``benchmarks.peers``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rest = os.environ.get("PYTHONPATH")
    return root if not rest else f"{root}{os.pathsep}{rest}"
