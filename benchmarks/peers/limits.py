"""Physical limits measured in the same run, on the same bytes, beside every path.

The whole set is measured once at the start of a run; the in-process ones (memcpy, O_DIRECT
read and write) are measured again right beside each FlatCake row (``local_limits``), and
that row is set against the sample taken beside it: under a load that swings by 2-4x within
minutes, a limit sampled minutes away says little about the row.

- memcpy of the session's bytes (local DRAM puts and restores);
- sequential O_DIRECT write and read of the session's bytes on the disk the stores use
  (SSD puts and restores);
- one raw NIXL READ of the session's bytes between two processes over UCX (remote DRAM),
  with UCX's default transports and with ``UCX_TLS=tcp``;
- TCP loopback: the session's bytes through one socket between two processes (the only
  transport Mooncake's non-CUDA wheel has here).

The NIXL and TCP limits run in processes spawned for them (UCX reads its environment when an
agent starts, so each transport choice needs fresh processes).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from benchmarks.peers.workload import Workload, check_bytes, gbps
from flatcake_ray.cli.benchkit import memcpy_gbps, odirect_read_gbps, odirect_write_gbps

UCX_MODES = {"default": None, "tcp": "tcp"}  # column -> UCX_TLS (None: leave UCX to choose)


@contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """Set (or, for None, unset) variables for processes started inside the block."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def spawn(target: Callable[..., None], *args: Any) -> tuple[Any, Any]:
    """A spawned process running ``target(conn, *args)``; returns (process, our end)."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=target, args=(theirs, *args), daemon=True)
    process.start()
    theirs.close()
    return process, ours


def answer(conn: Any, timeout_s: float = 600.0) -> Any:
    """The next message from a spawned process; raises its error, or if it died or hung."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer in {timeout_s:.0f} s")
    try:
        message = conn.recv()
    except EOFError as exc:
        raise RuntimeError("a spawned benchmark process died (its stderr says why)") from exc
    if isinstance(message, BaseException):
        raise message
    return message


def stop(process: Any, conn: Any) -> None:
    conn.close()
    process.join(10)
    if process.is_alive():
        process.kill()
        process.join(5)


# ---- NIXL READ between two processes -------------------------------------------------------
def _nixl_agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))


def _layer_descs(base: int, layers: int, layer_bytes: int) -> np.ndarray:
    """One descriptor per layer (address, length, device 0), as a layer-major read has."""
    return np.array([(base + i * layer_bytes, layer_bytes, 0) for i in range(layers)], np.uint64)


def _nixl_owner(conn: Any, workload: Workload, seed: int) -> None:
    try:
        data = workload.kv(seed).reshape(-1)
        agent = _nixl_agent(f"peers-limit-owner-{os.getpid()}")
        agent.register_memory([(int(data.ctypes.data), data.nbytes, 0, "")], "DRAM")
        conn.send((agent.get_agent_metadata(), int(data.ctypes.data)))
        conn.recv()  # until the reader is done
    except Exception as exc:
        conn.send(exc)


def _nixl_reader(conn: Any, workload: Workload, seed: int, meta: bytes, base: int) -> None:
    try:
        out = np.zeros(workload.nbytes, dtype=np.uint8)
        agent = _nixl_agent(f"peers-limit-reader-{os.getpid()}")
        agent.register_memory([(int(out.ctypes.data), out.nbytes, 0, "")], "DRAM")
        peer = agent.add_remote_agent(meta)
        layer_bytes = workload.nbytes // workload.layers
        local = agent.get_xfer_descs(
            _layer_descs(int(out.ctypes.data), workload.layers, layer_bytes), "DRAM"
        )
        remote = agent.get_xfer_descs(_layer_descs(base, workload.layers, layer_bytes), "DRAM")

        def read() -> None:
            handle = agent.initialize_xfer("READ", local, remote, peer)
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            handle.release()
            if state != "DONE":
                raise RuntimeError(f"NIXL READ ended {state}")

        read()  # connection setup, untimed
        check_bytes(out, workload.kv(seed).reshape(-1), "NIXL limit READ")
        times = []
        for _ in range(workload.rounds):
            start = time.perf_counter()
            read()
            times.append(time.perf_counter() - start)
        conn.send(gbps(workload.nbytes, min(times)))
    except Exception as exc:
        conn.send(exc)


def nixl_read_gbps(workload: Workload, ucx_tls: str | None) -> float:
    """Best rate of one NIXL READ of the session between two fresh processes."""
    with environment(UCX_TLS=ucx_tls):
        owner, owner_conn = spawn(_nixl_owner, workload, 7)
        try:
            meta, base = answer(owner_conn)
            reader, reader_conn = spawn(_nixl_reader, workload, 7, meta, base)
            try:
                return answer(reader_conn)
            finally:
                stop(reader, reader_conn)
        finally:
            owner_conn.send("done")
            stop(owner, owner_conn)


# ---- TCP loopback ---------------------------------------------------------------------------
def _tcp_receiver(conn: Any, nbytes: int, rounds: int) -> None:
    try:
        server = socket.create_server(("127.0.0.1", 0))
        conn.send(server.getsockname()[1])
        peer, _ = server.accept()
        buffer = memoryview(bytearray(nbytes))
        for _ in range(rounds):
            got = 0
            while got < nbytes:
                got += peer.recv_into(buffer[got:], nbytes - got)
            peer.sendall(b"k")
        peer.close()
        server.close()
    except Exception as exc:
        conn.send(exc)


def tcp_loopback_gbps(workload: Workload) -> float:
    """Best rate of the session's bytes through one 127.0.0.1 socket, acknowledged."""
    payload = memoryview(workload.kv(7).reshape(-1))
    rounds = workload.rounds + 1
    receiver, conn = spawn(_tcp_receiver, workload.nbytes, rounds)
    try:
        port = answer(conn)
        times = []
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for _ in range(rounds):
                start = time.perf_counter()
                sock.sendall(payload)
                if sock.recv(1) != b"k":
                    raise ConnectionError("TCP limit: the receiver did not acknowledge")
                times.append(time.perf_counter() - start)
        return gbps(workload.nbytes, min(times[1:]))
    finally:
        stop(receiver, conn)


# ---- all of them ----------------------------------------------------------------------------
LOCAL_LIMITS = ("memcpy", "odirect_write", "odirect_read")


def local_limits(workload: Workload, scratch: str, names: tuple[str, ...]) -> dict[str, float]:
    """The named in-process limits (``LOCAL_LIMITS``), GB/s, best of ``workload.rounds``:
    cheap enough (well under a second each here) to sample right beside the measurement
    they bound, as the harness does for every FlatCake row."""
    out: dict[str, float] = {}
    if "memcpy" in names:
        out["memcpy"] = memcpy_gbps(workload.nbytes, workload.rounds)
    if {"odirect_write", "odirect_read"} & set(names):
        os.makedirs(scratch, exist_ok=True)
        path = os.path.join(scratch, "odirect-limit.bin")
        data = workload.kv(7).reshape(-1)
        data = data[: data.nbytes // 4096 * 4096]  # O_DIRECT moves whole 4 KiB blocks
        try:
            write = odirect_write_gbps(path, data, workload.rounds)  # also lays the file out
            if "odirect_write" in names:
                out["odirect_write"] = write
            if "odirect_read" in names:
                out["odirect_read"] = odirect_read_gbps(
                    [path], data.nbytes, data.nbytes, workload.rounds
                )
        finally:
            os.unlink(path)
    return {name: round(value, 3) for name, value in out.items()}


def measure_limits(workload: Workload, scratch: str) -> dict[str, float]:
    """Every limit, GB/s (1e9 bytes/s): the best of ``workload.rounds`` (a limit is what the
    machine can do at best; the systems' figures are medians)."""
    limits = local_limits(workload, scratch, LOCAL_LIMITS)
    limits["tcp_loopback"] = tcp_loopback_gbps(workload)
    for mode, tls in UCX_MODES.items():
        limits[f"nixl_{mode}"] = nixl_read_gbps(workload, tls)
    return {name: round(value, 3) for name, value in limits.items()}
