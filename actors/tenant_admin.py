"""The operator's tenant commands, as the coordinator runs them (``flatcake-ray tenant``).

The coordinator is the table's one writer: it reads the signed table from the GCS, changes
it, and writes it back signed, under its own single-threaded call order. A new tenant's
secret is made here, returned once, and never stored (the table keeps its SHA-256). Storage
nodes pick a change up on their next report, or at once when they meet the new secret.
"""

from __future__ import annotations

import logging
from typing import Any

from flatcake_ray.actors.auth import Gate, write_table
from flatcake_ray.core.tenants import DEFAULT_TENANT, Tenant, new_secret, secret_hash
from flatcake_ray.errors import TenantError

log = logging.getLogger(__name__)


class TenantAdmin:
    def __init__(self, gate: Gate, service_secret: str, *, in_gcs: bool) -> None:
        self._gate = gate
        self._service_secret = service_secret
        self._in_gcs = in_gcs

    def _table(self) -> dict[str, Tenant]:
        """The current table: the GCS's if it is good, else the last good one this
        coordinator knows (then the next write replaces a forged or lost one)."""
        self._gate.refresh()
        return dict(self._gate.tenants)

    def _store(self, table: dict[str, Tenant]) -> None:
        if self._in_gcs:  # stored first: a failed write changes nothing here either
            write_table(self._gate.namespace, table, self._service_secret)
        self._gate.adopt(table)

    def add(
        self,
        name: str,
        layers: int,
        page_bytes: int,
        quota_dram: int | None = None,
        quota_ssd: int | None = None,
    ) -> str:
        """Create tenant ``name``; returns its secret (shown once, kept nowhere)."""
        if name == DEFAULT_TENANT:
            raise TenantError(f"{DEFAULT_TENANT!r} is the service's own open tenant")
        table = self._table()
        if name in table:
            raise TenantError(f"tenant {name} exists: remove it first to change its geometry")
        secret = new_secret()
        table[name] = Tenant(name, secret_hash(secret), layers, page_bytes, quota_dram, quota_ssd)
        self._store(table)
        log.info("tenant %s added (%d layers x %d bytes)", name, layers, page_bytes)
        return secret

    def set_quota(self, name: str, quota_dram: int | None, quota_ssd: int | None) -> None:
        table = self._table()
        known = self._require(table, name)
        table[name] = Tenant(
            name, known.secret_sha256, known.layers, known.page_bytes, quota_dram, quota_ssd
        )
        self._store(table)

    def remove(self, name: str) -> None:
        """Remove tenant ``name``: its calls are refused, its pages freed on every node."""
        table = self._table()
        self._require(table, name)
        del table[name]
        self._store(table)
        log.info("tenant %s removed", name)

    def rows(self) -> list[dict[str, Any]]:
        """The tenants, without their secrets' hashes."""
        return [
            {k: v for k, v in t.to_record().items() if k != "secret_sha256"}
            for t in sorted(self._table().values(), key=lambda t: t.name)
        ]

    @staticmethod
    def _require(table: dict[str, Tenant], name: str) -> Tenant:
        if name not in table:
            known = ", ".join(sorted(table)) or "none"
            raise TenantError(f"no tenant {name!r} (known: {known})")
        return table[name]
