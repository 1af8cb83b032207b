"""``flatcake-ray start | status | stop | drain | undrain | bench restore``: the service's
commands.

``start`` deploys on a running Ray cluster (``--address``, or ``RAY_ADDRESS``); with neither
and no cluster running it first starts a local single-node one (``ray start --head``). Sizes
and SSD folders come from a JSON or TOML config file (``--config``), then flags, then each
node's ``FLATCAKE_*`` variables. ``stop`` shuts the storage nodes (SSD scopes stay on disk)
and the coordinator down; ``--ray`` also stops the local Ray it runs on. ``drain NODE``
stops placing new scopes on a storage node before it is removed (``undrain`` reverses it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from flatcake_ray.config import ServiceConfig
from flatcake_ray.errors import ConfigError, ServiceError, UnknownNodeError

_SIZE_FLAGS = {
    "dram_bytes": "DRAM arena per node (e.g. 8GiB)",
    "ssd_file_bytes": "size of each pre-allocated SSD pool file",
    "ship_bytes": "NIXL bounce buffer per node for shipped SSD reads",
}


def load_config_file(path: str) -> dict[str, Any]:
    text = Path(path).read_text()
    if path.endswith(".toml"):
        import tomllib

        data = tomllib.loads(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold one table/object of ServiceConfig fields")
    return data.get("flatcake", data)


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    given: dict[str, Any] = load_config_file(args.config) if args.config else {}
    for name in ("root", "layers", "page_bytes", "ssd_files_per_dir", *_SIZE_FLAGS):
        value = getattr(args, name, None)
        if value is not None:
            given[name] = value
    if args.ssd_dirs:
        given["ssd_dirs"] = tuple(d for d in args.ssd_dirs.split(":") if d)
    if isinstance(given.get("ssd_dirs"), list):
        given["ssd_dirs"] = tuple(given["ssd_dirs"])
    given["namespace"] = args.namespace
    return ServiceConfig.from_env(**given)


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or auto)")
    parser.add_argument("--namespace", default="flatcake", help="the service's Ray namespace")


def _add_start(subparsers: Any) -> None:
    start = subparsers.add_parser("start", help="deploy the coordinator and storage nodes")
    _add_connection_flags(start)
    start.add_argument("--config", help="JSON or TOML file of ServiceConfig fields")
    start.add_argument("--root", help="per-node folder; {node} becomes the Ray node id")
    start.add_argument("--layers", type=int)
    start.add_argument("--page-bytes", dest="page_bytes")
    start.add_argument("--ssd-dirs", dest="ssd_dirs", help="colon-separated SSD folders")
    start.add_argument("--ssd-files-per-dir", dest="ssd_files_per_dir", type=int)
    for name, text in _SIZE_FLAGS.items():
        start.add_argument(f"--{name.replace('_', '-')}", dest=name, help=text)
    start.add_argument("--resource", help="only Ray nodes offering this custom resource")
    start.add_argument("--local-cpus", type=int, default=2, help="CPUs of a local Ray it starts")
    start.add_argument("--json", action="store_true", help="print the status as JSON")
    start.set_defaults(handler=cmd_start)


def _add_status_stop(subparsers: Any) -> None:
    status = subparsers.add_parser("status", help="nodes, NodeIDs, capacity, use, hits")
    _add_connection_flags(status)
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=cmd_status)
    stop = subparsers.add_parser("stop", help="stop the storage nodes and the coordinator")
    _add_connection_flags(stop)
    stop.add_argument("--ray", action="store_true", help="then `ray stop` on this machine")
    stop.set_defaults(handler=cmd_stop)


def _add_drain(subparsers: Any) -> None:
    drain = subparsers.add_parser(
        "drain", help="place no new scopes on a storage node (before removing it)"
    )
    undrain = subparsers.add_parser("undrain", help="place scopes on a drained node again")
    for parser, handler in ((drain, cmd_drain), (undrain, cmd_undrain)):
        parser.add_argument("node", type=int, help="the NodeID (`flatcake-ray status`)")
        _add_connection_flags(parser)
        parser.set_defaults(handler=handler)


def _bench_subparsers(subparsers: Any) -> Any:
    """The ``bench`` group's subparsers: the one already registered, or a new one."""
    bench = subparsers.choices.get("bench")
    if bench is None:
        bench = subparsers.add_parser("bench", help="benchmarks")
        return bench.add_subparsers(dest="bench_command", required=True)
    for action in bench._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return bench.add_subparsers(dest="bench_command", required=True)


def _add_bench(subparsers: Any) -> None:
    from flatcake_ray.cli.bench import add_bench_arguments

    restore = _bench_subparsers(subparsers).add_parser(
        "restore", help="cross-node restore bandwidth per path beside its limit"
    )
    add_bench_arguments(restore)
    restore.set_defaults(handler=cmd_bench_restore)


def add_service_commands(subparsers: Any) -> None:
    """Register ``start``, ``status``, ``stop``, ``drain``, ``undrain`` and ``bench restore``."""
    _add_start(subparsers)
    _add_status_stop(subparsers)
    _add_drain(subparsers)
    _add_bench(subparsers)


# ---- handlers --------------------------------------------------------------------------------
def _connect(args: argparse.Namespace, *, may_start: bool = False, cpus: int = 2) -> None:
    import ray

    from flatcake_ray.client.deploy import connect

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address is None and may_start and not _ray_running():
        _start_local_ray(cpus)
    try:
        connect(address, args.namespace)
    except ConnectionError as exc:
        raise ServiceError(f"no Ray cluster at {address or 'auto'}: {exc}") from exc
    assert ray.is_initialized()


def _ray_binary() -> str:
    beside = Path(sys.executable).with_name("ray")
    found = str(beside) if beside.exists() else shutil.which("ray")
    if found is None:
        raise ServiceError("the `ray` command is not installed")
    return found


def _ray_running() -> bool:
    result = subprocess.run(
        [_ray_binary(), "status"], capture_output=True, text=True, check=False, timeout=60
    )
    return result.returncode == 0


def _start_local_ray(cpus: int) -> None:
    command = [_ray_binary(), "start", "--head", f"--num-cpus={cpus}"]
    command += ["--include-dashboard=false", "--disable-usage-stats"]
    subprocess.run(command, check=True, capture_output=True, timeout=300)


def _print_status(info: dict[str, Any], as_json: bool) -> None:
    from flatcake_ray.client.deploy import format_status

    print(json.dumps(info, indent=2, default=str) if as_json else format_status(info))


def cmd_start(args: argparse.Namespace) -> int:
    from flatcake_ray.client.deploy import start

    config = config_from_args(args)
    _connect(args, may_start=True, cpus=args.local_cpus)
    _print_status(start(config, resource=args.resource), args.json)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from flatcake_ray.client.deploy import status

    _connect(args)
    info = status(args.namespace)
    _print_status(info, args.json)
    return 0 if info["nodes"] else 1


def cmd_stop(args: argparse.Namespace) -> int:
    import ray

    from flatcake_ray.client.deploy import stop

    _connect(args)
    stopped = stop(args.namespace)
    print(f"stopped {stopped} actors in namespace {args.namespace!r}")
    ray.shutdown()
    if args.ray:
        subprocess.run([_ray_binary(), "stop"], check=False, timeout=120)
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    from flatcake_ray.client.drain import drain

    _connect(args)
    try:
        row = drain(args.node, args.namespace)
    except UnknownNodeError as exc:
        # Raised in the coordinator: Ray's wrapper carries the actor's traceback; print the cause.
        print(f"flatcake-ray drain: {getattr(exc, 'cause', exc)}", file=sys.stderr)
        return 1
    print(
        f"NodeID {row['node_id']} (ray node {row['ray_node_id'][:12]}) drained: no new scopes "
        f"go there, its pages stay readable. Undo with `flatcake-ray undrain {args.node}`."
    )
    return 0


def cmd_undrain(args: argparse.Namespace) -> int:
    from flatcake_ray.client.drain import undrain

    _connect(args)
    changed = undrain(args.node, args.namespace)
    print(f"NodeID {args.node} {'undrained' if changed else 'was not drained'}")
    return 0


def cmd_bench_restore(args: argparse.Namespace) -> int:
    from flatcake_ray.cli.bench import run_from_args

    return run_from_args(args)
