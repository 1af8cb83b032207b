"""CPU that an idle ``flatcake-ray bench control`` cluster burns, per process kind: ours
(storage nodes, the coordinator) and Ray's (raylets, GCS, agents).

Every "node" of the bench is a raylet, its agents and a storage node on this machine's cores:
what they do in the background slows every Ray call the bench times. This starts the bench's
cluster with N storage nodes, lets it settle, and reads each process's CPU time from
``/proc`` (this process's descendants only: other jobs' clusters are left out) before and
after a quiet window.

    .venv/bin/python benchmarks/idle_cpu.py --nodes 16 --seconds 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict

from flatcake_ray.cli import bench_control
from flatcake_ray.cli.benchkit import bench_service_config
from flatcake_ray.client import deploy

TICKS = os.sysconf("SC_CLK_TCK")
KINDS = ("gcs_server", "raylet", "dashboard/agent", "runtime_env/agent", "log_monitor")


def _processes() -> dict[int, tuple[int, float, str]]:
    """pid -> (parent pid, CPU seconds, command line) of every process this user can read."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat_file:
                stat = stat_file.read()
            with open(f"/proc/{name}/cmdline") as cmd_file:
                command = cmd_file.read().replace("\0", " ")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS, command)
    return out


def _kind(command: str) -> str:
    for kind in KINDS:
        if kind in command:
            return kind
    return command.split(" ")[0][:40] or "other"


def cpu_by_kind() -> dict[int, tuple[str, float]]:
    """pid -> (kind, CPU seconds) of this process and its descendants."""
    processes, mine = _processes(), {os.getpid()}
    grew = True
    while grew:
        before = len(mine)
        mine |= {pid for pid, (parent, _, _) in processes.items() if parent in mine}
        grew = len(mine) > before
    return {pid: (_kind(processes[pid][2]), processes[pid][1]) for pid in mine if pid in processes}


def measure(nodes: int, seconds: float, settle_s: float = 15.0) -> dict:
    import ray

    root = tempfile.mkdtemp(prefix="fc-idle-cpu-", dir="/var/tmp")
    cluster = bench_control._start(nodes)
    ray.init(address=cluster.address, namespace=bench_control.NAMESPACE, log_to_driver=False)
    try:
        config = bench_service_config(
            bench_control.NAMESPACE, root, 1, 1024, dram_bytes=32 << 20, ssd_bytes=0
        )
        deploy.start(config, resource=bench_control.RESOURCE)
        time.sleep(settle_s)
        before, started, load = cpu_by_kind(), time.monotonic(), os.getloadavg()[0]
        time.sleep(seconds)
        after, elapsed = cpu_by_kind(), time.monotonic() - started
        used: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for pid, (kind, cpu) in after.items():
            if pid in before:
                used[kind][0] += cpu - before[pid][1]
                used[kind][1] += 1
        deploy.stop(bench_control.NAMESPACE)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    kinds = sorted(used.items(), key=lambda item: -item[1][0])
    return {
        "nodes": nodes,
        "load_before": round(load, 2),
        "cores_used": round(sum(cpu for cpu, _ in used.values()) / elapsed, 3),
        "by_kind": {k: {"cores": round(c / elapsed, 3), "processes": n} for k, (c, n) in kinds},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    print(json.dumps(measure(args.nodes, args.seconds), indent=1))


if __name__ == "__main__":
    main()
