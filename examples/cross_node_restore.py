"""Write a session from one node and restore it on another, through the Ray service.

Run on a running cluster with the service started (``flatcake-ray start``)::

    python examples/cross_node_restore.py --address auto

or with no arguments to start a two-node ``ray.cluster_utils.Cluster`` on 127.0.0.1 and the
service on it. A writer actor pinned to one node puts a DRAM session and an SSD session; a
reader pinned to every node restores both, checks the bytes, and prints which path served
each read (local-dram, local-ssd, remote-dram-nixl, remote-ssd-shipped, ...). With
``--bench`` it runs the restore benchmark instead (``flatcake-ray bench restore``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import numpy as np

NAMESPACE = "flatcake"
LAYERS, PAGES, PAGE_BYTES = 4, 64, 16 << 10


class Session:
    """One client, pinned to one node: writes and restores sessions of known bytes."""

    def __init__(self, namespace: str) -> None:
        from flatcake_ray.client.client import FlatCakeClient

        self.client = FlatCakeClient(namespace)

    def node(self) -> int:
        return self.client.nodes.local_node_id

    def write(self, name: str, medium: str, seed: int) -> str:
        from flatcake_ray.core.catalog import PutHints

        hints = PutHints(turn=2, prior_reply_tokens=1) if medium == "DRAM" else PutHints(turn=1)
        keys = [f"{name}/{i}" for i in range(PAGES)]
        return self.client.put(keys, _kv(seed), session_id=name, hints=hints).medium

    def restore(self, name: str, seed: int) -> tuple[int, list[str], bool, int]:
        keys = [f"{name}/{i}" for i in range(PAGES)]
        out = np.zeros((LAYERS, PAGES, PAGE_BYTES), dtype=np.uint8)
        report = self.client.restore_report(keys, out)
        return report.pages, list(report.paths), np.array_equal(out, _kv(seed)), report.node_id


def _kv(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (LAYERS, PAGES, PAGE_BYTES), dtype=np.uint8)


def _local_cluster(root: str):
    import ray
    from ray.cluster_utils import Cluster

    from flatcake_ray.client import deploy as service
    from flatcake_ray.config import ServiceConfig

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    config = ServiceConfig(
        namespace=NAMESPACE,
        root=os.path.join(root, "{node}"),
        layers=LAYERS,
        page_bytes=PAGE_BYTES,
        dram_bytes=64 << 20,
        ssd_file_bytes=64 << 20,
        ssd_files_per_dir=2,
        fsync=False,
    )
    service.start(config)
    return cluster


def run(address: str | None) -> int:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from flatcake_ray.client import deploy as service

    cluster = None
    if address is None:
        root = tempfile.mkdtemp(prefix="flatcake-example-")
        cluster = _local_cluster(root)
    else:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    nodes = service.service_nodes()
    actor = ray.remote(Session)
    clients = [
        actor.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n, False)
        ).remote(NAMESPACE)
        for n in nodes
    ]
    writer = clients[0]
    placed = {
        ray.get(writer.write.remote(f"example-{m.lower()}", m, seed)): seed
        for m, seed in (("DRAM", 1), ("SSD", 2))
    }
    ok = True
    for client in clients:
        here = ray.get(client.node.remote())
        for medium, seed in placed.items():
            pages, paths, exact, owner = ray.get(
                client.restore.remote(f"example-{medium.lower()}", seed)
            )
            ok &= exact and pages == PAGES
            print(
                f"reader on node {here}: {medium} session of node {owner}: {pages} pages "
                f"via {', '.join(paths)}, byte-exact={exact}"
            )
    if cluster is not None:
        service.stop(NAMESPACE)
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a running cluster with the service started")
    parser.add_argument("--bench", action="store_true", help="run the restore benchmark")
    args, rest = parser.parse_known_args(argv)
    if args.bench:
        from flatcake_ray.cli.bench import add_bench_arguments, run_from_args

        bench = argparse.ArgumentParser()
        add_bench_arguments(bench)
        extra = ["--address", args.address] if args.address else []
        return run_from_args(bench.parse_args([*rest, *extra]))
    return run(args.address)


if __name__ == "__main__":
    sys.exit(main())
