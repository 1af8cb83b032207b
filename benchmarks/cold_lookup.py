"""A cold ``locate(lease=True)`` whose chain lives on the client's machine, the other home
asked over its TCP call channel, or over Ray with and without waiting for it, in alternation.

Two storage nodes on a local Ray cluster; a Ray actor pinned to the first holds two clients
(``remote_direct_calls`` on and off), puts 3,421-page chains into DRAM until one is placed on
its own node, then alternates cold lookups (location cache forgotten) of it: over both call
channels (both homes asked at once, both answers read); over Ray to the other home as the
client does it (a home on this machine that answers the whole request over its channel ends
the lookup; the other home's Ray answer is read later); and over Ray with that early end
turned off (every home's answer waited for). Medians of ``--repeats`` each, the lookups'
control time in ms.

.venv/bin/python benchmarks/cold_lookup.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any

import numpy as np

LAYERS, PAGE_BYTES, PAGES = 4, 16 << 10, 3421


class ColdLookups:
    def __init__(self, namespace: str) -> None:
        from flatcake_ray.client.client import FlatCakeClient
        from flatcake_ray.config import ClientConfig

        self.client = FlatCakeClient(namespace)
        self.over_ray = FlatCakeClient(namespace, config=ClientConfig(remote_direct_calls=False))

    def run(self, repeats: int) -> dict[str, Any]:
        import flatcake_ray.client.locate as locate
        from flatcake_ray.core.catalog import PutHints

        kv = np.zeros((LAYERS, PAGES, PAGE_BYTES), np.uint8)
        dram = PutHints(turn=2, prior_reply_tokens=1, context_tokens=1)
        local, keys = self.client.nodes.local_node_id, None
        for i in range(16):
            names = [f"cold{i}/{j}" for j in range(PAGES)]
            self.client.put(names, kv, session_id=f"cold{i}", hints=dram)
            if self.client.locate(names).node_id == local:
                keys = names
                break
        if keys is None:
            raise RuntimeError("no chain of 16 was placed on the client's node")
        holds = locate._holds
        times: dict[str, list[float]] = {"channels": [], "early": [], "wait": []}
        try:
            for _ in range(repeats):
                for mode in times:
                    locate._holds = holds if mode != "wait" else lambda answer, pages: False
                    client = self.client if mode == "channels" else self.over_ray
                    client.forget_locations()
                    report = client.locate(keys, lease=True)
                    times[mode].append(report.control_seconds * 1e3)
                    client.stats(nodes=False)
        finally:
            locate._holds = holds
        return {mode: statistics.median(values) for mode, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from flatcake_ray.cli.benchkit import bench_service_config, load_average, running_service

    request = PAGES * LAYERS * PAGE_BYTES
    root = tempfile.mkdtemp(prefix="fc-cold-")
    config = bench_service_config(
        "fc-cold-bench", root, LAYERS, PAGE_BYTES,
        dram_bytes=4 * request, ssd_bytes=4 * request, request_bytes=request,
    )  # fmt: skip
    started_load = load_average()
    with running_service(config, None, 2, "flatcake_store", root) as targets:
        strategy = NodeAffinitySchedulingStrategy(targets[0], soft=False)
        actor = ray.remote(ColdLookups).options(num_cpus=0, scheduling_strategy=strategy)
        found = ray.get(actor.remote(config.namespace).run.remote(args.repeats))
    print(f"load average {started_load:.2f} at the start, {load_average():.2f} at the end")
    print(f"cold locate(lease=True), {PAGES} pages, owner on the client's machine, medians:")
    print(f"  both homes over call channels (TCP to the other): {found['channels']:.2f} ms")
    print(f"  the other over Ray, the local whole answer ends it: {found['early']:.2f} ms")
    print(f"  the other over Ray, every answer waited for:        {found['wait']:.2f} ms")


if __name__ == "__main__":
    main()
