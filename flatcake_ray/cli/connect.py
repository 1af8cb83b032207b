"""Connecting the CLI to a Ray cluster within a bounded time.

``ray.init`` against an address where no cluster runs retries for minutes (measured here:
still waiting after 300 s, and a timer signal does not interrupt it). So the CLI first
resolves the address the way Ray does (``--address``, then ``RAY_ADDRESS``, then the last
``ray start`` on this machine), opens a TCP connection to it, then asks Ray's own health
check, in a child process it can kill, whether a Ray cluster answers there; only then does
it call ``ray.init``. Each step is bounded by the connect timeout.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from flatcake_ray.errors import ServiceError

DEFAULT_CONNECT_TIMEOUT_S = 15.0
AUTH_MODE = "RAY_AUTH_MODE"


def token_available() -> bool:
    """Whether Ray would find an auth token here (its own order: variable, path, home)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return Path(path).expanduser().is_file()


def align_auth_mode() -> None:
    """For a local cluster found without an address, the mode ``ray start`` gave it: token
    auth when a token exists (``ray.init`` with an explicit address never infers it, so it
    would be refused). An explicit ``RAY_AUTH_MODE`` stays as the operator set it."""
    if AUTH_MODE not in os.environ and token_available():
        set_auth_mode("token")


def set_auth_mode(mode: str) -> None:
    """``RAY_AUTH_MODE`` for this process and its children. Ray reads it into its config when
    first imported: a process that imported Ray already has it re-read, as Ray itself does."""
    os.environ[AUTH_MODE] = mode
    if "ray" in sys.modules:
        from ray._raylet import Config  # type: ignore[attr-defined]  # a Cython module: no stubs name it

        Config.initialize("")


def ray_binary() -> str:
    beside = Path(sys.executable).with_name("ray")
    found = str(beside) if beside.exists() else shutil.which("ray")
    if found is None:
        raise ServiceError("the `ray` command is not installed")
    return found


def resolve_address(address: str | None) -> str:
    """``host:port`` of the cluster ``address`` names (None or "auto": found as Ray does)."""
    if address is not None and address.startswith("ray://"):
        return address.removeprefix("ray://")
    from ray._private import services

    try:
        return services.canonicalize_bootstrap_address_or_die(address)  # type: ignore[arg-type]  # None: the local cluster (Ray annotates str, accepts None)
    except (ConnectionError, ValueError) as exc:
        raise ServiceError(f"no Ray cluster to connect to ({address or 'auto'}): {exc}") from None


def probe(host_port: str, timeout_s: float) -> None:
    """Open (and close) a TCP connection to ``host:port``, or raise ServiceError."""
    host, sep, port = host_port.rpartition(":")
    if not sep or not port.isdigit():
        raise ServiceError(f"{host_port!r} is not a host:port address")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ServiceError(
            f"no Ray cluster answers at {host_port} within {timeout_s:g} s: {exc}"
        ) from None


def health_check(host_port: str, timeout_s: float) -> None:
    """Ray's own check that a cluster's GCS answers at ``host_port``, in a child process."""
    command = [ray_binary(), "health-check", "--address", host_port, "--skip-version-check"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ServiceError(
            f"no Ray cluster answers at {host_port} within {timeout_s:.3g} s "
            "(something accepts connections there, but it is not answering as Ray)"
        ) from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ServiceError(f"no healthy Ray cluster at {host_port}: {last}{_auth_hint(last)}")


def _auth_hint(message: str) -> str:
    if "auth" not in message.lower():
        return ""
    return (
        " (the cluster and this command disagree on token authentication: set RAY_AUTH_MODE"
        " to the cluster's mode, `token` with its token in ~/.ray/auth_token or"
        " RAY_AUTH_TOKEN_PATH)"
    )


def connect(address: str | None, namespace: str, timeout_s: float) -> None:
    """``ray.init`` on the cluster at ``address`` (None: as Ray finds it), or ServiceError
    within about ``timeout_s`` (per step: the TCP probe, the health check)."""
    import ray

    if ray.is_initialized():
        return
    if address is None:
        align_auth_mode()
    target = resolve_address(address)
    started = time.monotonic()
    probe(target, timeout_s)
    client = (address or "").startswith("ray://")
    if not client:  # a Ray client server has no GCS to check
        health_check(target, max(1.0, timeout_s - (time.monotonic() - started)))
    try:
        ray.init(address=address if client else target, namespace=namespace, log_to_driver=False)
    except ConnectionError as exc:
        raise ServiceError(f"cannot connect to the Ray cluster at {target}: {exc}") from exc
