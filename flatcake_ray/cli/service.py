"""``flatcake-ray start | status | stop | drain | undrain | bench restore | bench control``:
the service's commands.

``start`` deploys on a running Ray cluster (``--address``, or ``RAY_ADDRESS``); with neither
and no cluster running it first starts a local single-node one (``ray start --head``). Sizes
and SSD folders come from a JSON or TOML config file (``--config``), then flags, then each
node's ``FLATCAKE_*`` variables. Connecting gives up after ``--connect-timeout`` seconds
(15 by default) when no cluster answers. ``start`` against a running service with another
geometry (layers, page_bytes) is an error. ``stop`` shuts the storage nodes (SSD scopes
stay on disk) and the coordinator down; ``--ray`` also stops the local Ray that ``start``
started (that one only: other Ray clusters on the machine keep running).
``drain NODE`` stops placing new scopes on a storage node before it is removed (``undrain``
reverses it).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from flatcake_ray.cli.access import (
    add_connection_flags,
    connect_cli,
    namespace_of,
    operator_secret,
    positive_seconds,
    stop_local_ray,
)
from flatcake_ray.cli.tenant import add_tenant_commands
from flatcake_ray.config import ServiceConfig, Source, build_config
from flatcake_ray.config_sources import load_file
from flatcake_ray.errors import UnknownNodeError

_SIZE_FLAGS = {
    "dram_bytes": "DRAM arena per node (e.g. 8GiB)",
    "ssd_file_bytes": "size of each pre-allocated SSD pool file",
    "ship_bytes": "NIXL bounce buffer per node for shipped SSD reads",
    "landing_bytes": "node memory clients write puts' SSD layers into",
}
_CONFIG_FLAGS: tuple[str, ...] = (
    "namespace",
    "root",
    "layers",
    "page_bytes",
    "ssd_dirs",
    "ssd_files_per_dir",
)
_CONFIG_FLAGS += ("secret_file", "open_default", "default_beside_tenants", "private_node_memory")
_LIMIT_FLAGS = {
    "tenant_calls_per_s": "calls a second each tenant may make of each node (0: no limit)",
    "tenant_call_burst": "calls a tenant may make at once above that rate",
    "tenant_leases": "leases each tenant may hold on each node",
    "tenant_puts": "puts each tenant may have open on each node",
    "dram_chunks": "chunks of each node's arena, each owned by one tenant at a time",
}
_CONFIG_FLAGS += tuple(_LIMIT_FLAGS)


def load_config_file(path: str) -> dict[str, Any]:
    """The table of ServiceConfig fields in a JSON or TOML file (ConfigError otherwise)."""
    return load_file(path)


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """The config file, then flags, then ``FLATCAKE_*``: each value checked by its field's
    type, and errors name the field and where it came from."""
    sources = [Source.file(args.config)] if args.config else []
    flags = {name: getattr(args, name, None) for name in (*_CONFIG_FLAGS, *_SIZE_FLAGS)}
    sources.append(Source.flags(flags))
    sources.append(Source.environment(ServiceConfig))
    return build_config(ServiceConfig, *sources)


def _add_start(subparsers: Any) -> None:
    start = subparsers.add_parser("start", help="deploy the coordinator and storage nodes")
    add_connection_flags(start)
    start.add_argument("--config", help="JSON or TOML file of ServiceConfig fields")
    start.add_argument(
        "--root",
        help="per-node folder (default /var/tmp/flatcake/{namespace}/{host}-{slot}); "
        "{node} becomes the Ray node id",
    )
    start.add_argument("--layers", help="model layers (the geometry every node shares)")
    start.add_argument("--page-bytes", dest="page_bytes", help="bytes of a page of one layer")
    start.add_argument("--ssd-dirs", dest="ssd_dirs", help="colon-separated SSD folders")
    start.add_argument("--ssd-files-per-dir", dest="ssd_files_per_dir")
    for name, text in {**_SIZE_FLAGS, **_LIMIT_FLAGS}.items():
        start.add_argument(f"--{name.replace('_', '-')}", dest=name, help=text)
    start.add_argument(
        "--closed",
        dest="open_default",
        action="store_const",
        const=False,
        help="no open default tenant: every client presents a tenant secret",
    )
    start.add_argument(
        "--default-beside-tenants",
        dest="default_beside_tenants",
        action="store_const",
        const=True,
        help="keep the open default tenant open when named tenants exist (trusts every Ray "
        "job with the default tenant's pages)",
    )
    start.add_argument(
        "--debuggable-nodes",
        dest="private_node_memory",
        action="store_const",
        const=False,
        help="let debuggers and py-spy attach to the storage nodes (and with them every "
        "process of the service's OS user: it can then read every tenant's memory)",
    )
    start.add_argument("--resource", help="only Ray nodes offering this custom resource")
    start.add_argument("--local-cpus", type=int, default=2, help="CPUs of a local Ray it starts")
    start.add_argument("--json", action="store_true", help="print the status as JSON")
    start.set_defaults(handler=cmd_start)


def _add_status_stop(subparsers: Any) -> None:
    status = subparsers.add_parser(
        "status", help="nodes, capacity and use; hit rates, latency, quarantines per tenant"
    )
    add_connection_flags(status)
    status.add_argument("--json", action="store_true")
    status.add_argument(
        "--metrics-timeout",
        type=positive_seconds,
        default=3.0,
        help="seconds to wait for each Ray node's metrics endpoint",
    )
    status.set_defaults(handler=cmd_status)
    stop = subparsers.add_parser("stop", help="stop the storage nodes and the coordinator")
    add_connection_flags(stop)
    stop.add_argument(
        "--ray", action="store_true", help="then stop the local Ray that `start` started"
    )
    stop.set_defaults(handler=cmd_stop)


def _add_drain(subparsers: Any) -> None:
    drain = subparsers.add_parser(
        "drain", help="place no new scopes on a storage node (before removing it)"
    )
    undrain = subparsers.add_parser("undrain", help="place scopes on a drained node again")
    for parser, handler in ((drain, cmd_drain), (undrain, cmd_undrain)):
        parser.add_argument("node", type=int, help="the NodeID (`flatcake-ray status`)")
        add_connection_flags(parser)
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
    from flatcake_ray.cli.bench_control import add_control_arguments, cmd_bench_control

    control = _bench_subparsers(subparsers).add_parser(
        "control", help="lookup cost (nodes asked, ms) and coordinator load against cluster size"
    )
    add_control_arguments(control)
    control.set_defaults(handler=cmd_bench_control)


def add_service_commands(subparsers: Any) -> None:
    """Register ``start``, ``status``, ``stop``, ``drain``, ``undrain``, ``tenant`` and
    ``bench restore``."""
    _add_start(subparsers)
    add_tenant_commands(subparsers)
    _add_status_stop(subparsers)
    _add_drain(subparsers)
    _add_bench(subparsers)


# ---- handlers --------------------------------------------------------------------------------


def _print_status(info: dict[str, Any], as_json: bool) -> None:
    from flatcake_ray.client.deploy import format_status
    from flatcake_ray.metrics.view import format_view

    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return
    print(format_status(info))
    if "metrics" in info:
        print(format_view(info["metrics"]))


def cmd_start(args: argparse.Namespace) -> int:
    from flatcake_ray.client.deploy import start

    config = config_from_args(args)
    started_ray = connect_cli(args, config.namespace, may_start=True)
    try:
        info = start(config, resource=args.resource)
    except BaseException:
        if started_ray:  # a failed start leaves nothing running that it started
            stop_local_ray()
        raise
    _print_status(info, args.json)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from flatcake_ray.client.deploy import status
    from flatcake_ray.metrics.view import cluster_status

    connect_cli(args, namespace_of(args))
    info = status(namespace_of(args), operator_secret(args))
    # Hit rates and latency are measured where requests are made (clients): read them all
    # from Ray's metrics agents, as Prometheus does.
    info["metrics"] = cluster_status(args.metrics_timeout)
    _print_status(info, args.json)
    return 0 if info["nodes"] else 1


def cmd_stop(args: argparse.Namespace) -> int:
    connect_cli(args, namespace_of(args))  # first: it may set what Ray reads on import
    import ray

    from flatcake_ray.client.deploy import stop

    stopped = stop(namespace_of(args), operator_secret(args))
    print(f"stopped {stopped} actors in namespace {namespace_of(args)!r}")
    ray.shutdown()
    if args.ray:
        stop_local_ray()
        print("stopped the local Ray that `flatcake-ray start` started")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    from ray.exceptions import RayTaskError

    from flatcake_ray.client.drain import drain

    connect_cli(args, namespace_of(args))
    try:
        row = drain(args.node, namespace_of(args), operator_secret(args))
    except UnknownNodeError as exc:
        # Raised in the coordinator: Ray's wrapper carries the actor's traceback; keep the cause.
        cause = exc.cause if isinstance(exc, RayTaskError) else exc
        raise UnknownNodeError(str(cause)) from None
    print(
        f"NodeID {row['node_id']} (ray node {row['ray_node_id'][:12]}) drained: no new scopes "
        f"go there, its pages stay readable. Undo with `flatcake-ray undrain {args.node}`."
    )
    return 0


def cmd_undrain(args: argparse.Namespace) -> int:
    from flatcake_ray.client.drain import undrain

    connect_cli(args, namespace_of(args))
    changed = undrain(args.node, namespace_of(args), operator_secret(args))
    print(f"NodeID {args.node} {'undrained' if changed else 'was not drained'}")
    return 0


def cmd_bench_restore(args: argparse.Namespace) -> int:
    from flatcake_ray.cli.bench import run_from_args

    return run_from_args(args)
