"""``flatcake-ray tenant add | list | quota | remove``: the service's tenants.

``add NAME --layers L --page-bytes B [--quota-dram SIZE] [--quota-ssd SIZE]`` prints the new
tenant's secret, once: hand it to that tenant's clients (``FLATCAKE_TENANT_SECRET``). Each
tenant has its own model geometry (one service serves several models) and a quota per medium
(``none``: no quota). ``remove`` refuses the tenant's calls at once and frees its pages on
every node. These run where ``flatcake-ray start`` ran (they need the service secret).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from flatcake_ray.cli.access import (
    add_connection_flags,
    connect_cli,
    namespace_of,
    operator_secret,
)
from flatcake_ray.config_sources import parse_size
from flatcake_ray.errors import ConfigError


def _quota(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return int(parse_size(text))
    except ConfigError as exc:  # as argparse wants it: a usage error
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 8GiB) or none") from exc


def _positive(text: str) -> int:
    try:
        value = int(parse_size(text))
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer") from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def add_tenant_commands(subparsers: Any) -> None:
    tenant = subparsers.add_parser("tenant", help="add, list, change or remove tenants")
    commands = tenant.add_subparsers(dest="tenant_command", required=True)
    add = commands.add_parser("add", help="create a tenant; prints its secret once")
    add.add_argument("name", help="1 to 64 of [a-z0-9_-]")
    add.add_argument("--layers", type=_positive, required=True, help="the model's layers")
    add.add_argument(
        "--page-bytes", dest="page_bytes", type=_positive, required=True, help="bytes of a page"
    )
    quota = commands.add_parser("quota", help="change a tenant's quotas")
    quota.add_argument("name")
    for parser in (add, quota):
        parser.add_argument("--quota-dram", dest="quota_dram", type=_quota, default=None)
        parser.add_argument("--quota-ssd", dest="quota_ssd", type=_quota, default=None)
    listing = commands.add_parser("list", help="the tenants, their geometry and quotas")
    listing.add_argument("--json", action="store_true")
    remove = commands.add_parser("remove", help="refuse a tenant's calls and free its pages")
    remove.add_argument("name")
    handlers = {add: cmd_add, quota: cmd_quota, listing: cmd_list, remove: cmd_remove}
    for parser, handler in handlers.items():
        add_connection_flags(parser)
        parser.set_defaults(handler=handler)


def _connected(args: argparse.Namespace) -> tuple[str, str]:
    namespace = namespace_of(args)
    connect_cli(args, namespace)
    return namespace, operator_secret(args)


def cmd_add(args: argparse.Namespace) -> int:
    from flatcake_ray.client.tenants import add_tenant

    namespace, secret = _connected(args)
    tenant_secret = add_tenant(
        namespace,
        args.name,
        layers=args.layers,
        page_bytes=args.page_bytes,
        quota_dram=args.quota_dram,
        quota_ssd=args.quota_ssd,
        secret=secret,
    )
    print(f"tenant {args.name} added; its secret (shown once, give it to its clients as")
    print("FLATCAKE_TENANT_SECRET):")
    print(tenant_secret)
    print(
        "clients without a secret (the open default tenant) are refused from now on, unless "
        "the service runs with default_beside_tenants",
        file=sys.stderr,
    )
    return 0


def cmd_quota(args: argparse.Namespace) -> int:
    from flatcake_ray.client.tenants import set_quota

    namespace, secret = _connected(args)
    set_quota(
        namespace, args.name, quota_dram=args.quota_dram, quota_ssd=args.quota_ssd, secret=secret
    )
    print(f"tenant {args.name}: quotas set")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from flatcake_ray.client.tenants import list_tenants

    namespace, secret = _connected(args)
    rows = list_tenants(namespace, secret=secret)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'tenant':<24} {'layers':>6} {'page bytes':>10} {'DRAM quota':>12} {'SSD quota':>12}")
    for row in rows:
        dram, ssd = (row[k] if row[k] is not None else "-" for k in ("quota_dram", "quota_ssd"))
        print(f"{row['name']:<24} {row['layers']:>6} {row['page_bytes']:>10} {dram:>12} {ssd:>12}")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    from flatcake_ray.client.tenants import remove_tenant

    namespace, secret = _connected(args)
    remove_tenant(namespace, args.name, secret=secret)
    print(f"tenant {args.name} removed: its calls are refused, its pages freed on every node")
    return 0
