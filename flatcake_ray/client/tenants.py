"""The operator's tenant commands (``flatcake-ray tenant add | list | quota | remove``).

Each is one call to the coordinator, with the service secret (by default the one this machine
keeps, ``ServiceConfig.secret_file``). ``add`` returns the new tenant's secret: the only time
it is shown; the service keeps its SHA-256 only. A client acts for that tenant with
``ClientConfig.tenant_secret`` (``FLATCAKE_TENANT_SECRET``).
"""

from __future__ import annotations

from typing import Any

from flatcake_ray.client.deploy import ADMIN_TIMEOUT_S
from flatcake_ray.client.drain import admin_call


def add_tenant(
    namespace: str,
    name: str,
    *,
    layers: int,
    page_bytes: int,
    quota_dram: int | None = None,
    quota_ssd: int | None = None,
    secret: str | None = None,
    timeout_s: float = ADMIN_TIMEOUT_S,
) -> str:
    """Create a tenant; returns its secret (shown once)."""
    args = (name, layers, page_bytes, quota_dram, quota_ssd)
    return str(admin_call(namespace, "add_tenant", secret, *args, timeout_s=timeout_s))


def list_tenants(
    namespace: str, *, secret: str | None = None, timeout_s: float = ADMIN_TIMEOUT_S
) -> list[dict[str, Any]]:
    return list(admin_call(namespace, "list_tenants", secret, timeout_s=timeout_s))


def set_quota(
    namespace: str,
    name: str,
    *,
    quota_dram: int | None,
    quota_ssd: int | None,
    secret: str | None = None,
    timeout_s: float = ADMIN_TIMEOUT_S,
) -> None:
    quotas = (quota_dram, quota_ssd)
    admin_call(namespace, "set_tenant_quota", secret, name, *quotas, timeout_s=timeout_s)


def remove_tenant(
    namespace: str, name: str, *, secret: str | None = None, timeout_s: float = ADMIN_TIMEOUT_S
) -> None:
    """Remove a tenant: its calls are refused at once, its pages freed on every node."""
    admin_call(namespace, "remove_tenant", secret, name, timeout_s=timeout_s)
