"""The one-node Ray that ``flatcake-ray start`` starts when no cluster runs, and only it.

``ray start --head`` turns token authentication on by itself when a token exists
(``~/.ray/auth_token``, as ``examples/cluster.yaml`` tells operators to make), while a later
``ray.init`` given an explicit address never does: the CLI would start a Ray that refuses the
CLI. So the local Ray gets its mode stated (token when a token exists, else disabled), and
every command that connects to a local cluster found without an address takes the same
mode (``connect.align_auth_mode``).

The local Ray listens on 127.0.0.1 with ports of its own (no fixed 6379/10001/52365 that
another cluster on the machine may hold), and is recorded in a state file beside the
service secret. ``stop --ray`` and a ``start`` that fails after starting it stop exactly
that Ray, by its session's processes: ``ray stop`` would stop every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from flatcake_ray.cli.connect import AUTH_MODE, ray_binary, set_auth_mode, token_available
from flatcake_ray.errors import ServiceError

STOP_GRACE_S = 10.0
SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def use_loopback() -> None:
    """Keep this process's Ray traffic on 127.0.0.1: unless told the cluster is one machine,
    Ray replaces a 127.0.0.1 address with the machine's outward one. Ray reads this when
    first imported, so it is set before (the CLI imports Ray only once connected)."""
    os.environ.setdefault(SINGLE_MACHINE, "0")


@dataclass(frozen=True)
class LocalRay:
    """A one-node Ray this machine's CLI started: where it answers and its session folder
    (every one of its processes names that folder on its command line)."""

    address: str
    session_dir: str
    auth_mode: str


def state_file() -> Path:
    return Path.home() / ".flatcake" / "local-ray.json"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(cpus: int) -> LocalRay:
    """Start a one-node Ray on 127.0.0.1, record it, and return it."""
    mode = "token" if token_available() else "disabled"
    port = _free_port()
    command = [ray_binary(), "start", "--head", f"--num-cpus={cpus}"]
    command += ["--node-ip-address=127.0.0.1", f"--port={port}"]
    command += [f"--ray-client-server-port={_free_port()}"]
    command += [f"--dashboard-agent-listen-port={_free_port()}"]
    command += ["--include-dashboard=false", "--disable-usage-stats"]
    env = {**os.environ, AUTH_MODE: mode}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    address = f"127.0.0.1:{port}"
    session = _session_of(port)
    if result.returncode != 0:
        if session is not None:
            stop(LocalRay(address, session, mode))
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ServiceError(f"`ray start --head` failed: {last}")
    if session is None:
        raise ServiceError(f"`ray start --head` reported success but no GCS runs on port {port}")
    set_auth_mode(mode)
    local = LocalRay(address, session, mode)
    path = state_file()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(local)))
    return local


def recorded() -> LocalRay | None:
    """The local Ray this machine's CLI started and has not stopped, if any."""
    try:
        return LocalRay(**json.loads(state_file().read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as exc:
        raise ServiceError(f"{state_file()} is not a local Ray record: {exc}") from None


def stop(local: LocalRay) -> int:
    """Stop every process of ``local``'s session (TERM, then KILL after a grace period) and
    forget the record; returns how many processes there were."""
    pids = _session_pids(local.session_dir)
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and _alive(pids):
        time.sleep(0.1)
    _signal_all(_alive(pids), signal.SIGKILL)
    if recorded() == local:
        state_file().unlink(missing_ok=True)
    return len(pids)


def session_alive(session_dir: str) -> bool:
    return bool(_session_pids(session_dir))


def _session_of(port: int) -> str | None:
    """The session folder of the GCS serving ``port`` (from its ``--log_dir``)."""
    for cmdline in _cmdlines().values():
        if "gcs_server" in cmdline[0] and f"--gcs_server_port={port}" in cmdline:
            for arg in cmdline:
                if arg.startswith("--log_dir="):
                    return str(Path(arg.removeprefix("--log_dir=")).parent)
    return None


def _session_pids(session_dir: str) -> list[int]:
    marker = session_dir.rstrip("/") + "/"
    return [
        pid
        for pid, cmdline in _cmdlines().items()
        if any(marker in arg or arg.endswith(session_dir) for arg in cmdline)
    ]


def _cmdlines() -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        # A process may end between listing and reading: it is then no longer ours to stop.
        with contextlib.suppress(OSError):
            raw = (entry / "cmdline").read_bytes()
            if raw:
                found[int(entry.name)] = raw.rstrip(b"\0").decode(errors="replace").split("\0")
    return found


def _alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists() and not _zombie(pid)]


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
