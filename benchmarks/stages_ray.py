"""The Ray client's paths for ``benchmarks/stages.py``: local and remote DRAM and SSD, restore
and put, on a 2-node cluster on 127.0.0.1 (``benchmarks/peers``' FlatCake harness), the stages
timed inside the client's process; rows named "ray ..." beside the in-process ones. Limits
beside each row: memcpy and O_DIRECT as in process; remote DRAM against one raw NIXL READ of
the same bytes between two fresh processes."""

from __future__ import annotations

import os
import statistics
from typing import Any

from benchmarks.peers.flatcake_worker import FlatCakeWorker, seed_of
from benchmarks.peers.limits import local_limits, nixl_read_gbps
from benchmarks.peers.sys_flatcake import FlatCakeBench
from benchmarks.peers.workload import Workload, check_bytes
from benchmarks.stage_clock import StageClock, summarise


class StageWorker(FlatCakeWorker):
    """A FlatCake client whose stages are timed (the clock lives in its process)."""

    def __init__(self, namespace: str, workload: Workload) -> None:
        super().__init__(namespace, workload)
        self.clock = StageClock().install()

    def staged_puts(self, sessions: list[str], medium: str) -> list[dict[str, float]]:
        rows: list[dict[str, float]] = []
        for session in sessions:
            keys = self.workload.keys(session)
            kv = self.workload.kv(seed_of(session))
            with self.clock.op(rows):
                self.client.put(keys, kv, session_id=session, hints=self._hints(medium))
        return rows

    def staged_restores(self, session: str, rounds: int) -> list[dict[str, float]]:
        keys = self.workload.keys(session)
        out = self._buffer(len(keys))
        expected = self.workload.kv(seed_of(session))
        rows: list[dict[str, float]] = []
        for r in range(rounds + 1):  # round 0 warms up (mappings, connections), untimed
            out.fill(0)
            sink: list[dict[str, float]] = rows if r else []
            with self.clock.op(sink):
                report = self.client.restore_report(keys, out)
            if report.pages != len(keys):
                raise AssertionError(f"restored {report.pages} of {len(keys)} ({report.failures})")
            check_bytes(out, expected, f"stages {session}")
        return rows


class StageBench(FlatCakeBench):
    worker_class = StageWorker


def run_ray(
    pages: int, layers: int, page_bytes: int, rounds: int, root: str, paths: tuple[str, ...]
) -> dict[str, Any]:
    """``paths``: which of ``benchmarks.stages.RAY_PATHS`` (``ssd-remote``: the remote SSD
    put and restore)."""
    import ray

    os.environ.setdefault("FLATCAKE_DRAM_POLICY", "table2")  # SSD rows read SSD homes
    workload = Workload(pages, layers, page_bytes, 2)
    scratch = os.path.join(root, "limits")
    nbytes = workload.nbytes
    results: dict[str, Any] = {}
    nixl = [nixl_read_gbps(workload, None)]
    with StageBench(workload, os.path.join(root, "ray"), 64) as bench:
        for medium in ("DRAM", "SSD"):
            limit_name = "memcpy" if medium == "DRAM" else "odirect_read"
            put_limit = "memcpy" if medium == "DRAM" else "odirect_write"
            for side in ("local", "remote"):
                tag = f"{medium.lower()}-{side}"
                if tag not in paths:
                    continue
                sessions = [f"{tag}-{r}" for r in range(rounds + 1)]
                limits = [local_limits(workload, scratch, (put_limit,))[put_limit]]
                rows = []
                for session in sessions:  # each to the side of its own owner
                    owner = bench.seeded(session, medium)
                    writer = bench.first(owner if side == "local" else bench.other(owner))
                    rows += ray.get(writer.staged_puts.remote([session], medium))
                rows = rows[1:]  # the first put warms up
                limits.append(local_limits(workload, scratch, (put_limit,))[put_limit])
                limits = _remote_limit(side, medium, limits, nixl)
                results[f"ray {side} {medium} put"] = summarise(nbytes, rows, limits)
                reader = writer
                limits = [local_limits(workload, scratch, (limit_name,))[limit_name]]
                rows = ray.get(reader.staged_restores.remote(sessions[-1], rounds))
                limits.append(local_limits(workload, scratch, (limit_name,))[limit_name])
                if side == "remote" and medium == "DRAM":
                    nixl.append(nixl_read_gbps(workload, None))
                limits = _remote_limit(side, medium, limits, nixl)
                results[f"ray {side} {medium} restore"] = summarise(nbytes, rows, limits)
    return results


def _remote_limit(side: str, medium: str, disk: list[float], wire: list[float]) -> list[float]:
    """A remote row's limit: the wire (raw NIXL) for DRAM, the lower of disk and wire for SSD."""
    if side == "local":
        return disk
    if medium == "DRAM":
        return wire
    return [min(statistics.median(disk), statistics.median(wire))]
