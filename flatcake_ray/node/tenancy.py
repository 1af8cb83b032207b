"""A store's tenants: one catalog each, over the store's shared media.

Every tenant has its own index, sessions, scopes and leases (its own :class:`Catalog`), its own
model geometry (layers, page bytes: one service serves several models) and a quota per
medium; the catalogs share the store's allocation spaces and id source. So a tenant's lookups
can only ever find its own pages, and its reclamation only ever frees its own scopes. An
in-process store has the ``default`` tenant, with the store's geometry and no quota; a storage
node adds the service's tenants as they are registered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from flatcake_ray.config import StoreConfig
from flatcake_ray.core.catalog import Catalog, Ids, Lease, Scope, media_spaces
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.runs import align_up
from flatcake_ray.core.tenants import DEFAULT_TENANT, Tenant, check_tenant_name
from flatcake_ray.errors import TenantError


class Tenancy:
    def __init__(self, config: StoreConfig, on_free: Callable[[Scope], None]) -> None:
        self.config = config
        self.space = media_spaces(config)
        self.ids = Ids()
        self._on_free = on_free
        self._catalogs: dict[str, Catalog] = {}
        self.ensure(DEFAULT_TENANT, config.layers, config.page_bytes)

    def __iter__(self) -> Iterator[Catalog]:
        return iter(list(self._catalogs.values()))

    def __contains__(self, name: str) -> bool:
        return name in self._catalogs

    def catalog(self, name: str) -> Catalog:
        """The catalog of tenant ``name`` (a typed error for a tenant this store lacks)."""
        try:
            return self._catalogs[name]
        except KeyError:
            raise TenantError(f"no tenant {name!r} on this store") from None

    def ensure(
        self,
        name: str,
        layers: int,
        page_bytes: int,
        quota: dict[Medium, int | None] | None = None,
    ) -> Catalog:
        """Tenant ``name``'s catalog, made on first use; its geometry may change only while
        it holds no page (its pages would become unreadable)."""
        check_tenant_name(name)
        known = self._catalogs.get(name)
        if known is not None and (known.config.layers, known.config.page_bytes) != (
            layers,
            page_bytes,
        ):
            if known.segments:
                raise TenantError(
                    f"tenant {name} holds pages of {known.config.layers} layers x "
                    f"{known.config.page_bytes} bytes; it cannot become {layers} x {page_bytes}"
                )
            known = None
        if known is None:
            config = dataclasses.replace(self.config, layers=layers, page_bytes=page_bytes)
            known = Catalog(
                config, space=self.space, ids=self.ids, tenant=name, on_free=self._on_free
            )
            self._catalogs[name] = known
        if quota is not None:
            known.set_quota(quota)
        return known

    def set_tenant(self, tenant: Tenant) -> Catalog:
        quota = {Medium.DRAM: tenant.quota_dram, Medium.SSD: tenant.quota_ssd}
        return self.ensure(tenant.name, tenant.layers, tenant.page_bytes, quota)

    def seals(self, name: str) -> bool:
        """Whether tenant ``name``'s SSD pages are written sealed (its key is known)."""
        catalog = self._catalogs.get(name)
        return catalog is not None and catalog.seal_key is not None

    def learn_seal(self, name: str, key: bytes) -> None:
        """Tenant ``name``'s seal key, derived from the secret a caller just presented (the
        service keeps only secrets' hashes, so the node learns it from its callers)."""
        catalog = self._catalogs.get(name)
        if catalog is not None:
            catalog.seal_key = key

    def remove(self, name: str) -> int:
        """Free every scope of tenant ``name`` (its leases and puts must be gone); returns the
        bytes freed."""
        catalog = self._catalogs.pop(name, None)
        if catalog is None:
            return 0
        freed = sum(catalog.free_scope(scope) for scope in list(catalog.scopes.values()))
        for space in self.space.values():  # a tenant of this name added again is another
            space.forget(name)
        return freed

    def lease_runs(self, lease: Lease, medium: Medium) -> list[tuple[int, int]]:
        """The ``[start, end)`` spans on ``medium`` of the runs of ``lease``'s scopes that are
        still there, each to the end of its used bytes rounded up to the read alignment."""
        if lease.tenant not in self:
            return []
        scopes = self.catalog(lease.tenant).scopes
        runs = [
            run
            for scope_id in lease.scope_ids
            if scope_id in scopes and scopes[scope_id].medium is medium
            for run in scopes[scope_id].runs.runs
        ]
        return [(r.start, r.start + min(r.length, align_up(r.used))) for r in runs]
