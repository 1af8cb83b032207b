"""Mooncake Store: a master and two store clients on 127.0.0.1 ("node" A and B), each client a
spawned process, TCP transport (the only one the non-CUDA wheel has without RDMA).

One object per page: its layers are the object's slices, put and got with the zero-copy
``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` from buffers registered
once. Local DRAM: A reads objects in its own segment; remote: B reads them. Puts choose the
segment with ``ReplicateConfig.preferred_segment``.

SSD: the master runs with ``--enable_offload``, the clients with ``enable_ssd_offload``; a
put lands in DRAM and the segment's owner writes it to its disk in buckets of
``MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT`` keys (a divisor of the session, else the tail stays in
DRAM; at most 500: a bucket is one vectored write, and larger ones fail here with
``FILE_WRITE_FAIL``). The SSD put rate is the session's bytes over the time until every key
has a disk replica. For SSD restores the DRAM replicas
are cleared (``batch_replica_clear`` on A's segment, after the 5 s leases lapse) and the bucket
files dropped from the page cache, so gets read the drive.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import time
from typing import Any

from benchmarks.peers.limits import answer, environment, spawn, stop
from benchmarks.peers.mooncake_client import client_main
from benchmarks.peers.workload import (
    CONTROL_SAMPLES,
    Workload,
    aggregate,
    gbps,
    median,
    start_gate,
)

# A get fails (LEASE_EXPIRED) if it outlasts its lease: DRAM leases match FlatCake's 60 s TTL;
# SSD leases are short: DRAM replicas clear only once leases lapse, and a get of a disk-only
# object that still holds a lease (even its reader's own, from the last get) fails with
# OBJECT_HAS_LEASE, so each SSD get waits for the last lease to lapse (untimed).
LOOPBACK = "127.0.0.1"  # every listener and peer address of this bench
LEASE_TTL_MS = {"dram": 60_000, "ssd": 5_000}
MAX_BUCKET_KEYS = 500


def bucket_keys(pages: int) -> int:
    """The largest divisor of ``pages`` not above ``MAX_BUCKET_KEYS``."""
    return max(d for d in range(1, min(pages, MAX_BUCKET_KEYS) + 1) if pages % d == 0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def mooncake_bin() -> str:
    import mooncake

    return os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")


# ---- the master and the clients -------------------------------------------------------------
class MooncakeCluster:
    def __init__(self, workload: Workload, root: str, *, ssd: bool, segment_bytes: int) -> None:
        self.workload, self.root, self.ssd = workload, root, ssd
        self.segment_bytes = segment_bytes
        self.master: subprocess.Popen | None = None
        self.clients: list[tuple[Any, Any, str]] = []  # process, conn, segment name
        self.master_port, self.meta_port = free_port(), free_port()
        self.lease_ms = LEASE_TTL_MS["ssd" if ssd else "dram"]

    def env(self) -> dict[str, str]:
        lanes = str(max(1024, 4 * self.workload.pages))  # batches over 1,024 objects
        env = {
            "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": lanes,
            "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": lanes,
            "GLOG_minloglevel": "2",
            "MC_STORE_CLIENT_METRIC": "0",
            # The transfer engine's TCP transport listens on the machine's external
            # interface unless told: every system of the bench talks over loopback only.
            "MC_TCP_BIND_ADDRESS": LOOPBACK,
        }
        if self.ssd:
            env["MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT"] = str(bucket_keys(self.workload.pages))
            env["MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS"] = "1"
        return env

    def __enter__(self) -> MooncakeCluster:
        os.makedirs(self.root, exist_ok=True)
        args = [
            mooncake_bin(),
            f"--rpc_port={self.master_port}",
            f"--rpc_address={LOOPBACK}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={LOOPBACK}",
            f"--http_metadata_server_port={self.meta_port}",
            f"--metrics_port={free_port()}",
            f"--default_kv_lease_ttl={self.lease_ms}",
        ]
        if self.ssd:
            args.append("--enable_offload=true")
        log = open(os.path.join(self.root, "master.log"), "wb")
        self.master = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait_port(self.master_port)
        for name in ("a", "b"):
            self.add_client(name, self.segment_bytes, self.workload.pages)
        return self

    def add_client(self, name: str, segment_bytes: int, pages: int) -> Any:
        hostname = f"127.0.0.1:{free_port()}"
        spec = {
            "local_hostname": hostname,
            "metadata_server": f"http://127.0.0.1:{self.meta_port}/metadata",
            "global_segment_size": segment_bytes,
            "local_buffer_size": 64 << 20,
            "protocol": "tcp",
            "rdma_devices": "",
            "master_server_addr": f"127.0.0.1:{self.master_port}",
            "pages": pages,
        }
        if self.ssd:
            spec["enable_ssd_offload"] = True
            spec["ssd_offload_path"] = os.path.join(self.root, f"ssd-{name}")
        with environment(**self.env()):
            process, conn = spawn(client_main, spec, self.workload)
        self.clients.append((process, conn, hostname))
        answer(conn)
        return conn

    def __exit__(self, *exc: object) -> None:
        for process, conn, _ in self.clients:
            with contextlib.suppress(OSError, EOFError):
                conn.send(("stop", ()))
                conn.poll(10)
            stop(process, conn)
        if self.master is not None:
            self.master.terminate()
            try:
                self.master.wait(10)
            except subprocess.TimeoutExpired:
                self.master.kill()
                self.master.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def call(self, index: int, command: str, *args: Any) -> Any:
        conn = self.clients[index][1]
        conn.send((command, args))
        return answer(conn)

    def segment(self, index: int) -> str:
        return self.clients[index][2]

    def before_ssd_get(self) -> None:
        time.sleep(self.lease_ms / 1e3 + 0.5)
        self.drop_page_cache()

    def drop_page_cache(self) -> None:
        """Evict the offloaded bucket files from the page cache (per file, no global drop)."""
        for path in glob.glob(os.path.join(self.root, "ssd-*", "**", "*"), recursive=True):
            if os.path.isfile(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _wait_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the Mooncake master did not listen on {port}")


def _seed(session: str) -> int:
    from benchmarks.peers.flatcake_worker import seed_of

    return seed_of(session)


def _get_rate(
    mc: MooncakeCluster, reader: int, session: str, pages: int, before: Any = None
) -> float:
    """One warm-up get, then ``rounds`` timed: median GB/s."""
    times = []
    for round_ in range(mc.workload.rounds + 1):
        if before is not None:
            before()
        got = mc.call(reader, "get", session, pages, _seed(session))
        if round_:
            times.append(got["end"] - got["start"])
    return gbps(pages * mc.workload.object_bytes, median(times))


# ---- the two phases -------------------------------------------------------------------------
def run_dram(workload: Workload, root: str, clients: list[int], scale_pages: int) -> dict[str, Any]:
    segment = (
        2 * workload.rounds + 3
    ) * workload.nbytes + 8 * 2 * 4 * scale_pages * workload.object_bytes
    with MooncakeCluster(workload, root, ssd=False, segment_bytes=segment) as mc:
        put = {"local DRAM": [], "remote DRAM": []}
        for r in range(workload.rounds + 1):
            for label, target in (("local DRAM", 0), ("remote DRAM", 1)):
                got = mc.call(
                    0,
                    "put",
                    f"mc-{label[:3]}-{r}",
                    workload.pages,
                    _seed(f"mc-{label[:3]}-{r}"),
                    mc.segment(target),
                )
                if r:
                    put[label].append(got["end"] - got["start"])
        source = "mc-loc-0"  # in A's segment
        result = {
            "put": {k: {"gbps": gbps(workload.nbytes, median(v))} for k, v in put.items()},
            "restore": {
                "local DRAM": {"gbps": _get_rate(mc, 0, source, workload.pages)},
                "remote DRAM": {"gbps": _get_rate(mc, 1, source, workload.pages)},
            },
        }
        controls = [mc.call(1, "control", source, workload.pages) for _ in range(CONTROL_SAMPLES)]
        result["control"] = {k: median([c[k] for c in controls]) for k in ("exist_ms", "lease_ms")}
        if clients:
            result["scale"] = _scale(mc, workload, clients, scale_pages)
    return result


def _scale(
    mc: MooncakeCluster, workload: Workload, clients: list[int], pages: int
) -> dict[int, Any]:
    """``k`` pure clients (no segment) per "node": half put into A's segment, half into B's;
    all restore one session in A's segment (a separate process is remote to Mooncake)."""
    source = "mc-scale-src"
    mc.call(0, "put", source, pages, _seed(source), mc.segment(0))
    team: list[int] = []
    out = {}
    for k in clients:
        while len(team) < 2 * k:
            mc.add_client(f"c{len(team)}", 0, pages)
            team.append(len(mc.clients) - 1)
            mc.call(team[-1], "prepare", source, pages, _seed(source))
        restores, puts = [], []
        for r in range(-1, workload.rounds):  # as FlatCake's: together, bytes made apart
            at = start_gate(len(team))
            runs = _all(mc, team, [("get", (source, pages, _seed(source), at, False))] * len(team))
            _all(mc, team, [("check", (source, pages, _seed(source)))] * len(team))
            if r >= 0:
                restores.append(aggregate(runs))
            names = [f"mc-scale-{k}-{r}-{n}" for n in range(len(team))]
            _all(mc, team, [("prepare", (name, pages, _seed(name))) for name in names])
            at = start_gate(len(team))
            calls = [
                ("put", (name, pages, _seed(name), mc.segment(n % 2), at))
                for n, name in enumerate(names)
            ]
            runs = _all(mc, team, calls)
            if r >= 0:
                puts.append(aggregate(runs))
        out[k] = {"restore_gbps": median(restores), "put_gbps": median(puts), "clients": 2 * k}
    return out


def _all(mc: MooncakeCluster, team: list[int], calls: list[tuple[str, tuple]]) -> list[Any]:
    """Send each client of ``team`` its call at once; their answers, in order."""
    for i, call in zip(team, calls, strict=True):
        mc.clients[i][1].send(call)
    return [answer(mc.clients[i][1]) for i in team]


def run_ssd(workload: Workload, root: str) -> dict[str, Any]:
    segment = (2 * workload.rounds + 3) * workload.nbytes
    with MooncakeCluster(workload, root, ssd=True, segment_bytes=segment) as mc:
        put = {"local SSD": [], "remote SSD": []}
        for r in range(workload.rounds + 1):
            for label, writer in (("local SSD", 0), ("remote SSD", 1)):
                session = f"mc-ssd-{writer}-{r}"
                got = mc.call(writer, "put", session, workload.pages, _seed(session), mc.segment(0))
                durable = _wait_on_disk(mc, session, workload.pages)
                if r:
                    put[label].append(durable - got["start"])
        source = "mc-ssd-0-0"
        time.sleep(mc.lease_ms / 1e3 + 0.5)  # replicas clear only once their leases lapse
        mc.call(0, "clear_dram", source, workload.pages, mc.segment(0))
        left = mc.call(0, "on_disk", source, workload.pages)
        if left != {"disk": workload.pages, "dram": 0}:
            raise RuntimeError(f"Mooncake SSD: after clearing DRAM, replicas are {left}")
        return {
            "put": {k: {"gbps": gbps(workload.nbytes, median(v))} for k, v in put.items()},
            "restore": {
                "local SSD": {"gbps": _get_rate(mc, 0, source, workload.pages, mc.drop_page_cache)},
                "remote SSD": {
                    "gbps": _get_rate(mc, 1, source, workload.pages, mc.drop_page_cache)
                },
            },
            "bucket_keys": bucket_keys(workload.pages),
        }


def _wait_on_disk(mc: MooncakeCluster, session: str, pages: int, timeout_s: float = 120.0) -> float:
    """Poll until every key of ``session`` has a disk replica; returns that wall-clock time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if mc.call(0, "on_disk", session, pages)["disk"] == pages:
            return time.time()
        time.sleep(0.05)
    raise TimeoutError(f"Mooncake did not offload {session} to SSD in {timeout_s:.0f} s")
