"""Who calls a storage node: the caller's tenant from its secret, and the node's copy of the
tenant table kept in step with the store (a tenant removed from the table loses its pages,
leases, home records and limits here).

``StorageNode`` calls :meth:`NodeTenants.caller` first in every tenant call and
:meth:`NodeTenants.sync` before each report and when the coordinator says the table changed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from flatcake_ray.actors.auth import Gate
from flatcake_ray.actors.tenant_limits import TenantLimits
from flatcake_ray.core.tenants import Tenant, seal_key
from flatcake_ray.node.store import FlatCakeStore

log = logging.getLogger(__name__)


class NodeTenants:
    def __init__(
        self, gate: Gate, store: FlatCakeStore, limits: TenantLimits, counters: dict[str, int]
    ) -> None:
        self.gate, self.store, self.limits, self.counters = gate, store, limits, counters
        self.table: dict[str, Tenant] = {}
        # What else holds per-tenant state on the node (leases, home records): told on removal.
        self.on_removed: list[Callable[[str], object]] = []
        self._lock = threading.Lock()
        self.sync()

    def caller(self, secret: object, *, metered: bool = True) -> Tenant:
        """The caller's tenant (registered with the store on first sight), or refused; a
        ``metered`` call counts against the tenant's call rate (``TenantLimits``)."""
        tenant = self.gate.tenant(secret)
        if self.table.get(tenant.name) != tenant:
            self.sync()
        if secret and not self.store.tenancy.seals(tenant.name):
            self.store.tenancy.learn_seal(tenant.name, seal_key(secret))
        if metered:
            self.limits.call(tenant.name)
        return tenant

    def sync(self) -> None:
        """Give the store the table's tenants; drop the pages of those removed from it."""
        with self._lock:
            table = dict(self.gate.tenants)
            for tenant in table.values():
                if self.table.get(tenant.name) != tenant:
                    self.store.set_tenant(tenant)
            for name in set(self.table) - set(table):
                self._remove(name)
            self.table = table

    def _remove(self, name: str) -> None:
        for drop in self.on_removed:
            drop(name)
        self.limits.drop_tenant(name)
        self.store.remove_tenant(name)
        self.counters["tenants_removed"] += 1
        log.info("tenant %s removed from the service: its pages here are freed", name)
