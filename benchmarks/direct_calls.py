"""What direct calls save a client on the storage node's machine, side by side in one run.

A one-node service on a local Ray cluster; a Ray actor pinned to that node holds two
FlatCakeClients, one with ``direct_calls`` (lookups and releases over the node's call channel,
``client/direct.py``) and one without (every call a Ray actor call), and alternates them:
a warm ``locate(lease=True)`` of a ``--pages`` request, a whole restore of it from the
node's DRAM (checked: ``verify_dram``, the default), and puts of new 512-page sessions into
DRAM. Beside them, the stages of one direct
lookup: hashing the keys, the ``lookup`` round trip, a ``release`` and a one-key ``exists``
(the channel's floor), and an empty Ray actor call (Ray's). ``--remote``: the clients on a
second Ray node with no storage node (another machine to the service: TCP call channels,
``remote_direct_calls``; restores by NIXL).

.venv/bin/python benchmarks/direct_calls.py [--pages 3421] [--repeats 30] [--remote]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np

LAYERS, PAGE_BYTES = 4, 16 << 10
PUT_PAGES = 512  # a put of a new 512-page session (33.5 MB), as an engine saves a request


class Pair:
    """Two clients on the storage node's Ray node: direct calls on and off."""

    def __init__(self, namespace: str) -> None:
        from flatcake_ray.client.client import FlatCakeClient
        from flatcake_ray.config import ClientConfig

        self.clients = {
            flag: FlatCakeClient(
                namespace, config=ClientConfig(direct_calls=flag, remote_direct_calls=flag)
            )
            for flag in (True, False)
        }

    def run(self, pages: int, repeats: int) -> dict[str, Any]:
        from flatcake_ray.core.catalog import PutHints

        on = self.clients[True]
        keys = [f"direct/{i}" for i in range(pages)]
        kv = np.random.default_rng(0).integers(0, 256, (LAYERS, pages, PAGE_BYTES), np.uint8)
        dram = PutHints(turn=2, prior_reply_tokens=1, context_tokens=1)
        medium = on.put(keys, kv, session_id="direct", hints=dram).medium
        out = np.zeros_like(kv)
        times: dict[str, list[float]] = {}

        def clock(name: str, work: Any) -> Any:
            started = time.perf_counter()
            value = work()
            times.setdefault(name, []).append((time.perf_counter() - started) * 1e3)
            return value

        for client in self.clients.values():  # first uses: channels, mappings, threads
            for _ in range(3):
                client.locate(keys, lease=True)
                client.restore_report(keys, out)
        for _ in range(repeats):
            for flag, client in self.clients.items():
                clock(f"locate {flag}", lambda c=client: c.locate(keys, lease=True))
        for _ in range(max(repeats // 2, 3)):
            for flag, client in self.clients.items():
                report = clock(f"restore {flag}", lambda c=client: c.restore_report(keys, out))
                assert report.pages == pages and np.array_equal(out, kv)
        self._puts(kv[:, : min(pages, PUT_PAGES)], max(repeats // 3, 3), clock)
        self._stages(on, keys, repeats, clock)
        found = {name: round(statistics.median(values), 3) for name, values in times.items()}
        return {"times": found, "medium": getattr(medium, "name", str(medium)), "bytes": kv.nbytes}

    def _puts(self, kv: np.ndarray, repeats: int, clock: Any) -> None:
        """Puts of new sessions (nothing of them stored yet) into DRAM, the clients
        alternated; the first round warms up."""
        from flatcake_ray.core.catalog import PutHints

        dram = PutHints(turn=2, prior_reply_tokens=1, context_tokens=1)
        for round_ in range(repeats + 1):
            for flag, client in self.clients.items():
                session = f"put/{flag}/{round_}"
                keys = [f"{session}/{i}" for i in range(kv.shape[1])]

                def put(c: Any = client, k: list[str] = keys, s: str = session) -> Any:
                    return c.put(k, kv, session_id=s, hints=dram)

                result = clock(f"put {flag}", put) if round_ else put()
                assert result.medium is not None and result.medium.name == "DRAM"

    @staticmethod
    def _stages(client: Any, keys: list[str], repeats: int, clock: Any) -> None:
        import ray

        from flatcake_ray.client.source import digests_of

        link = next(iter(client.nodes.links.values()))  # the one storage node
        call = link.direct.call
        for _ in range(repeats):
            digests = clock("hash the keys", lambda: digests_of(keys, None))
            reply = clock("direct lookup", lambda d=digests: call("lookup", d))
            clock("direct release", lambda r=reply: call("release", r.lease_id, []))
            clock("direct exists, 1 key", lambda d=digests: call("exists", d[:1]))
            clock("empty Ray call", lambda: ray.get(link.handle.actor.ping.remote()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=3421)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--remote", action="store_true", help="clients off the node's machine")
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from flatcake_ray.cli.benchkit import bench_service_config, load_average, running_service

    request = args.pages * LAYERS * PAGE_BYTES
    root = tempfile.mkdtemp(prefix="fc-direct-")
    config = bench_service_config(
        "fc-direct-bench",
        root,
        LAYERS,
        PAGE_BYTES,
        dram_bytes=2 * request + 2 * (args.repeats // 3 + 2) * PUT_PAGES * LAYERS * PAGE_BYTES,
        ssd_bytes=4 * request,
        request_bytes=request,
    )
    started_load = load_average()
    bare = int(args.remote)
    with running_service(config, None, 1, "flatcake_store", root, bare_nodes=bare) as targets:
        alive = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
        where = next(n for n in alive if n not in targets) if args.remote else targets[0]
        strategy = NodeAffinitySchedulingStrategy(where, soft=False)
        pair = ray.remote(Pair).options(num_cpus=0, scheduling_strategy=strategy)
        found = ray.get(pair.remote(config.namespace).run.remote(args.pages, args.repeats))
    times = found["times"]
    print(f"load average {started_load:.2f} at the start, {load_average():.2f} at the end")
    where = "from another Ray node (TCP channels)" if args.remote else "on the node's Ray node"
    print(f"{args.pages} pages x {LAYERS} layers x {PAGE_BYTES} B ({found['medium']}); clients")
    print(f"{where}; ms, medians")
    print("| | direct calls | Ray calls | direct / Ray |\n|---|---:|---:|---:|")
    names = {"locate": "warm locate", "restore": "restore", "put": f"put, {PUT_PAGES} new pages"}
    for what, name in names.items():
        on, off = times[f"{what} True"], times[f"{what} False"]
        print(f"| {name} | {on:.2f} | {off:.2f} | {on / off:.2f} |")
    gbps = {flag: found["bytes"] / times[f"restore {flag}"] / 1e6 for flag in (True, False)}
    print(f"restore GB/s: direct {gbps[True]:.2f}, Ray {gbps[False]:.2f}")
    print("| stage | ms |\n|---|---:|")
    for name in ("hash the keys", "direct lookup", "direct release", "direct exists, 1 key"):
        print(f"| {name} | {times[name]:.3f} |")
    print(f"| empty Ray call | {times['empty Ray call']:.3f} |")


if __name__ == "__main__":
    main()
