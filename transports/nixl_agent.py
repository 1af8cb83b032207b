"""The NIXL agent every NIXL path of this package shares (UCX backend), and its probe.

:class:`NixlAgent` wraps one ``nixl_agent``: memory and file registrations, peers, one-sided
READ and WRITE transfers with a deadline, and the progress mode (``"thread"``: NIXL's own
progress thread; ``"none"``: the caller progresses its own transfers; ``"pump"``: a light
thread of ours, for owners whose memory is read by others). Readers
(``nixl_dram.NixlDramTransport``), exporters (``nixl_dram.NixlArenaExporter``) and the
writer (``nixl_write.NixlDramWriter``) build on it; ``actors/nixl_roles.py`` says which role
runs which mode.

UCX reads ``UCX_TLS``/``UCX_NET_DEVICES`` when an agent is created (tests pin
``UCX_NET_DEVICES=lo``); an empty ``UCX_TLS`` makes UCX refuse to start. Importing nixl
imports torch on a CPU-only torch build (nixl's CUDA probe): seconds, once per process.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flatcake_ray.errors import (
    PeerDisconnectedError,
    ShapeError,
    TransferError,
    TransferTimeoutError,
    TransportClosedError,
    TransportUnavailableError,
)
from flatcake_ray.transports.base import (
    RegistrationCache,
)

DEFAULT_TIMEOUT_S = 30.0
PUMP_INTERVAL_S = 0.0005
# A pump with nothing out to peers polls this often (woken at once by ``wake``): 2,000 idle
# polls a second per node took ~5 % of a core each, and a cluster of many nodes on few cores
# (``flatcake-ray bench control``) slowed every Ray call with them.
PUMP_IDLE_S = 0.05
PUMP_LINGER_S = 0.25  # full rate after a wake, before ``busy`` has had its say
PROGRESS_MODES = ("thread", "none", "pump")
_POLL_SLEEP_MAX_S = 0.001
_names = itertools.count()


def _skip_ucx_ib_without_devices() -> None:
    """Keep UCX from loading its InfiniBand module where there is no RDMA device.

    The module brings a bundled libnl-route whose destructor crashes at process exit
    (SIGSEGV in ``rtnl_tc_unregister``; every nixl wheel from 0.10 to 1.5 here), so any
    process that made a NIXL agent exited with 139. Without a device the module has nothing to
    drive. An operator's own ``UCX_MODULES`` wins."""
    devices = Path("/sys/class/infiniband")
    if "UCX_MODULES" not in os.environ and not (devices.is_dir() and any(devices.iterdir())):
        os.environ["UCX_MODULES"] = "^ib"


@functools.cache
def _nixl_api() -> Any:
    """Import nixl on first use, keeping its import-time side effects off the process."""
    _skip_ucx_ib_without_devices()
    raise_exceptions = logging.raiseExceptions
    try:
        import nixl._api as api
    except ImportError as exc:
        raise TransportUnavailableError(f"nixl is not importable: {exc}") from exc
    # nixl's logging setup flips this global for every logger in the process; put it back.
    logging.raiseExceptions = raise_exceptions
    if not os.environ.get("NIXL_LOG_LEVEL"):
        # Each agent otherwise prints INFO lines to stdout, which corrupts CLI output.
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return api


@functools.cache
def _nixl_errors() -> tuple[type[Exception], ...]:
    """nixl's binding exceptions share no base class; collect them by name."""
    bindings = _nixl_api().nixlBind
    names = [n for n in dir(bindings) if n.startswith("nixl") and n.endswith("Error")]
    return tuple(getattr(bindings, n) for n in names)


def nixl_probe(backend: str) -> str | None:
    """``None`` if nixl imports and has the ``backend`` plugin, else why not."""
    if importlib.util.find_spec("nixl") is None:
        return "nixl not installed"
    try:
        api = _nixl_api()
        plugins = api.nixl_agent(unique_agent_name("probe"), api.nixl_agent_config(backends=[]))
    except TransportUnavailableError as exc:
        return str(exc)
    except (RuntimeError, *_nixl_errors()) as exc:  # type: ignore[misc]
        return f"nixl unusable: {exc!r}"
    if backend not in plugins.get_plugin_list():
        return f"nixl has no {backend} plugin"
    return None


def unique_agent_name(role: str) -> str:
    """An agent name unique across the cluster (peers are told apart by name)."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{next(_names)}"


def buffer_address(buffer: np.ndarray) -> int:
    if not isinstance(buffer, np.ndarray) or buffer.ndim != 1 or buffer.dtype != np.uint8:
        raise ShapeError("a NIXL buffer must be a 1-D uint8 numpy array")
    if not buffer.flags.c_contiguous:
        raise ShapeError("a NIXL buffer must be C-contiguous")
    return int(buffer.ctypes.data)


class NixlAgent:
    """One NIXL agent (a UCX/POSIX context) and the local buffers registered with it; one per
    process per role is enough. ``progress``: ``"thread"`` (NIXL's thread, which polls without
    pause: a busy core), ``"none"`` (a reader progresses its own request as it polls), or
    ``"pump"`` (polls every ``pump_interval_s`` while ``busy()`` or just after ``wake``, every
    ``PUMP_IDLE_S`` otherwise: for memory others READ over UCX TCP/shm)."""

    def __init__(
        self,
        name: str,
        *,
        backends: Sequence[str] = ("UCX",),
        max_registrations: int = 8,
        progress: str = "thread",
        pump_interval_s: float = PUMP_INTERVAL_S,
        busy: Callable[[], bool] | None = None,
    ) -> None:
        if progress not in PROGRESS_MODES:
            raise ValueError(f"progress must be one of {PROGRESS_MODES}, not {progress!r}")
        api = _nixl_api()
        config = api.nixl_agent_config(
            enable_prog_thread=progress == "thread",
            backends=list(backends),
            # Reads may come from several threads; RW lets transfers run concurrently while
            # registration and metadata changes take the agent exclusively.
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )
        try:
            self._agent = api.nixl_agent(name, config)
        except (RuntimeError, *_nixl_errors()) as exc:  # type: ignore[misc]
            raise TransportUnavailableError(
                f"NIXL agent {name!r} with {list(backends)} failed to start: {exc!r} "
                "(UCX's reason is on stderr; an empty UCX_TLS is one)"
            ) from exc
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise TransportUnavailableError(f"NIXL has no {missing} plugin")
        self.name = name
        self.progress = progress
        self._stuck: list[tuple[Any, np.ndarray]] = []
        self.destinations = RegistrationCache(self.register, self.deregister, max_registrations)
        self._stop = threading.Event()
        self._woken = threading.Event()
        self._busy = busy if busy is not None else lambda: True
        self._fast_until = 0.0
        self._pump: threading.Thread | None = None
        if progress == "pump":
            pump = threading.Thread(target=self._run_pump, args=(pump_interval_s,), daemon=True)
            self._pump = pump
            pump.start()

    def _run_pump(self, interval_s: float) -> None:
        agent = self._agent
        while not self._stop.is_set():
            # Fetching notifications progresses the UCX workers: a peer's READ completes.
            agent.get_new_notifs()
            if time.monotonic() < self._fast_until or self._busy():
                self._stop.wait(interval_s)
            else:  # nothing out to peers: poll slowly until woken
                self._woken.wait(PUMP_IDLE_S)
                self._woken.clear()

    def wake(self) -> None:
        """Peers are about to READ or WRITE (a lease, a put, a ship region was handed out):
        the pump polls at full rate for ``PUMP_LINGER_S``, then while ``busy`` says so."""
        self._fast_until = time.monotonic() + PUMP_LINGER_S
        self._woken.set()

    @property
    def _live(self) -> Any:
        if self._agent is None:
            raise TransportClosedError(f"NIXL agent {self.name} is closed")
        return self._agent

    def register(self, buffer: np.ndarray) -> Any:
        """Register host memory with every backend that takes DRAM; returns the handle."""
        descs = [(buffer_address(buffer), buffer.nbytes, 0, "")]
        return self._call("register memory", self._live.register_memory, descs, "DRAM")

    def register_file(self, fd: int, size: int) -> Any:
        return self._call("register file", self._live.register_memory, [(0, size, fd, "")], "FILE")

    def deregister(self, registration: Any) -> None:
        self._call("deregister memory", self._live.deregister_memory, registration)

    def metadata(self) -> bytes:
        """Everything a peer needs to reach this agent's registered memory."""
        return self._live.get_agent_metadata()

    def partial_metadata(self, buffers: Sequence[np.ndarray]) -> bytes:
        """What a peer needs to reach ``buffers`` (each a whole registration) and nothing
        else this agent registered: the peer's NIXL refuses any other address of ours."""
        agent = self._live
        rows = [(buffer_address(b), b.nbytes, 0) for b in buffers]
        table = np.array(rows, dtype=np.uint64).reshape(-1, 3)  # none: the connection alone
        descs = _nixl_api().nixlBind.nixlRegDList(agent.nixl_mems["DRAM"], table)
        return self._call("partial metadata", agent.get_partial_agent_metadata, descs, True, [])

    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self._live.add_remote_agent(metadata)
        except _nixl_errors() as exc:
            raise PeerDisconnectedError(f"cannot connect to the NIXL peer: {exc!r}") from exc
        return name.decode() if isinstance(name, bytes) else name

    def remove_peer(self, name: str) -> None:
        self._call("remove peer", self._live.remove_remote_agent, name)

    def read(
        self,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        remote_kind: str,
        *,
        timeout_s: float,
        dst: np.ndarray,
    ) -> None:
        """READ ``remote`` descriptors (N x 3: address/offset, length, device/fd) of ``peer``
        into ``local`` ones (inside ``dst``); returns when done, else raises TransferError."""
        self._transfer("READ", peer, local, remote, remote_kind, timeout_s, dst)

    def write(
        self,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        *,
        timeout_s: float,
        src: np.ndarray,
    ) -> None:
        """WRITE ``local`` descriptors (inside ``src``) into ``peer``'s DRAM ``remote`` ones;
        returns when the bytes are at the peer, else raises TransferError."""
        self._transfer("WRITE", peer, local, remote, "DRAM", timeout_s, src)

    def _transfer(
        self,
        op: str,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        remote_kind: str,
        timeout_s: float,
        buffer: np.ndarray,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        agent = self._live
        local_descs = agent.get_xfer_descs(local, "DRAM")
        remote_descs = agent.get_xfer_descs(remote, remote_kind)
        handle = self._call(
            f"create {op}", agent.initialize_xfer, op, local_descs, remote_descs, peer
        )
        try:
            state = self._call(f"post {op}", agent.transfer, handle)
            state = self._wait(agent, handle, state, deadline)
        except TransferTimeoutError:
            self._cancel(handle, buffer)
            raise
        except BaseException:
            self._call(f"release failed {op}", handle.release)
            raise
        self._call(f"release {op}", handle.release)
        if state != "DONE":
            raise TransferError(f"NIXL {op} with {peer} failed (state {state})")

    def _wait(self, agent: Any, handle: Any, state: str, deadline: float) -> str:
        pause = 0.0
        while state == "PROC":
            if time.monotonic() > deadline:
                raise TransferTimeoutError("NIXL transfer did not complete before its deadline")
            if pause:  # spin first: small reads finish in microseconds
                time.sleep(pause)
            pause = min(_POLL_SLEEP_MAX_S, pause * 2 or 1e-5)
            state = self._call("check transfer", agent.check_xfer_state, handle)
        return state

    def _cancel(self, handle: Any, dst: np.ndarray) -> None:
        try:
            handle.release()  # cancels the in-flight request
        except _nixl_errors() as exc:
            # The NIC may still write: keep the request and its memory alive until close.
            self._stuck.append((handle, dst))
            raise TransferTimeoutError(
                "NIXL transfer timed out and could not be cancelled"
            ) from exc

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except _nixl_errors() as exc:
            gone = type(exc).__name__ == "nixlRemoteDisconnectError"
            error = PeerDisconnectedError if gone else TransferError
            raise error(f"NIXL {what} failed on agent {self.name}: {exc!r}") from exc

    def close(self) -> None:
        """Drop registrations and the agent (its UCX context and threads); idempotent."""
        if self._agent is None:
            return
        self._stop.set()
        self._woken.set()
        if self._pump is not None:
            self._pump.join()
            self._pump = None
        self.destinations.clear()
        while self._stuck:
            handle, _ = self._stuck[-1]
            self._call("release stuck READ", handle.release)
            self._stuck.pop()
        self._agent = None
