"""How an operator command reaches the service: its connection flags, the namespace and service
secret it acts with, and connecting to the Ray cluster (starting a local one for ``start``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from flatcake_ray.cli.connect import DEFAULT_CONNECT_TIMEOUT_S
from flatcake_ray.config import secret_path
from flatcake_ray.errors import ServiceError

DEFAULT_NAMESPACE = "flatcake"


def namespace_of(args: argparse.Namespace) -> str:
    return args.namespace or DEFAULT_NAMESPACE


def operator_secret(args: argparse.Namespace) -> str:
    """The service secret an operator command presents (``--secret-file``, else the
    machine's own for the namespace)."""
    from flatcake_ray.actors.auth import read_secret

    return read_secret(secret_path(namespace_of(args), args.secret_file or ""))


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or auto)")
    parser.add_argument("--namespace", help=f"the service's Ray namespace ({DEFAULT_NAMESPACE})")
    parser.add_argument(
        "--connect-timeout",
        type=positive_seconds,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        help="give up connecting to the Ray cluster after this many seconds",
    )
    parser.add_argument(
        "--secret-file",
        dest="secret_file",
        help="the service secret (default: FLATCAKE_SECRET_FILE, else "
        "~/.flatcake/{namespace}.secret, made by the first start)",
    )


def connect_cli(args: argparse.Namespace, namespace: str, *, may_start: bool = False) -> bool:
    """Connect to the cluster the flags, ``RAY_ADDRESS`` or this machine name; with
    ``may_start`` and none running, start a local one first. True when it started one."""
    from flatcake_ray.cli import local_ray
    from flatcake_ray.cli.connect import AUTH_MODE, connect, set_auth_mode

    if _connected():  # a process already on a cluster (a driver calling ``main``) stays there
        return False
    address = args.address or os.environ.get("RAY_ADDRESS")
    started = False
    local = local_ray.recorded() if address is None else None
    if local is not None and local_ray.session_alive(local.session_dir):
        local_ray.use_loopback()
        address = local.address
        if AUTH_MODE not in os.environ:
            set_auth_mode(local.auth_mode)
    elif address is None:
        address = _this_machines_cluster(args.connect_timeout)
        if address is None and not may_start:
            raise ServiceError(
                "no Ray cluster to connect to: give --address (or RAY_ADDRESS), or let "
                "`flatcake-ray start` start a local one"
            )
        if address is None:
            local_ray.use_loopback()
            address = local_ray.start(args.local_cpus).address
            started = True
    try:
        connect(address, namespace, args.connect_timeout)
    except BaseException:
        if started:
            stop_local_ray()
        raise
    return started


def stop_local_ray() -> None:
    import ray

    from flatcake_ray.cli import local_ray

    ray.shutdown()
    local = local_ray.recorded()
    if local is None:
        raise ServiceError(
            "no local Ray started by `flatcake-ray start` is recorded on this machine "
            f"({local_ray.state_file()}); stop a Ray you started yourself with `ray stop`"
        )
    local_ray.stop(local)


def _connected() -> bool:
    """Whether this process is on a cluster already; never imports Ray to find out (the
    settings it reads on import may still be set)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _this_machines_cluster(timeout_s: float) -> str | None:
    """The cluster the last ``ray start`` here made, if it still answers (in the token mode
    Ray gives a local cluster found without an address)."""
    from flatcake_ray.cli.connect import align_auth_mode, answers, last_ray_start

    address = last_ray_start()
    if address is None or not answers(address, timeout_s):
        return None
    align_auth_mode()
    return address
