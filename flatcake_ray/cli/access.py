"""How an operator command reaches the service: its connection flags, the namespace and service
secret it acts with, and connecting to the Ray cluster (starting a local one for ``start``).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess

from flatcake_ray.cli.connect import DEFAULT_CONNECT_TIMEOUT_S, ray_binary
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


def connect_cli(args: argparse.Namespace, namespace: str, *, may_start: bool = False) -> None:
    from flatcake_ray.cli.connect import connect

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address is None and may_start and not _ray_running(args.connect_timeout):
        _start_local_ray(args.local_cpus)
    connect(address, namespace, args.connect_timeout)


def _ray_running(timeout_s: float) -> bool:
    try:
        result = subprocess.run(
            [ray_binary(), "status"],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise ServiceError(f"`ray status` did not answer within {timeout_s:g} s") from None
    return result.returncode == 0


def _start_local_ray(cpus: int) -> None:
    command = [ray_binary(), "start", "--head", f"--num-cpus={cpus}"]
    command += ["--include-dashboard=false", "--disable-usage-stats"]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
