"""The StorageNode calls that look keys up, lease what they find and let leases go (mixed
into ``StorageNode``, which provides the attributes declared below and ``_tenant``).

One call a request a node, whatever the page count: ``lookup`` leases the consecutive hits
(the caller's earlier leases here may ride along to be released first), ``exists`` and
``probe`` only count them, ``gvas`` names where they are. A lease pins its scopes until its
reader releases it or ``lease_ttl_s`` passes; ``release`` answers whether every scope it
pinned is intact, and only then is what its reader copied good (``actors/leases.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from flatcake_ray.actors.leases import LeaseTable
from flatcake_ray.actors.node_exports import NodeExports
from flatcake_ray.actors.protocol import LeaseReply
from flatcake_ray.actors.tenant_limits import TenantLimits
from flatcake_ray.actors.wire import check_request, lease_ids, scope_ids
from flatcake_ray.core.api import Probe
from flatcake_ray.core.parts import lease_parts
from flatcake_ray.core.tenants import Tenant
from flatcake_ray.failpoints import failpoint
from flatcake_ray.node.store import FlatCakeStore


class LookupCalls:
    store: FlatCakeStore
    leases: LeaseTable
    limits: TenantLimits
    exports: NodeExports
    counters: dict[str, int]
    node_id: int
    started_at: float

    def _tenant(self, secret: object, *, metered: bool = True) -> Tenant:
        raise NotImplementedError

    def lookup(
        self, secret: object, keys: Any, namespace: Any = None, releases: Any = ()
    ) -> LeaseReply:
        """The consecutive hits from the first key, leased (zero hits: nothing is held).
        ``releases``: the caller's earlier leases here it lets go of and wants no answer
        for, released first (one call instead of a release each)."""
        tenant = self._tenant(secret).name
        check_request(keys, namespace)
        for lease_id in lease_ids(releases):
            self._release(tenant, lease_id)
        self._expire_leases()
        self.limits.lease(tenant, self.leases.held_by(tenant))
        self.counters["lookups"] += 1
        lease = self.store.lease(keys, namespace=namespace, tenant=tenant)
        if lease.hits == 0:
            self.store.release(lease)
            return LeaseReply(self.node_id, 0, 0, epoch=self.started_at)
        lease_id = self.leases.add(lease)
        self.exports.wake()
        self.counters["leased_pages"] += lease.hits
        parts = lease_parts(lease)
        return LeaseReply(self.node_id, lease_id, lease.hits, parts, epoch=self.started_at)

    def exists(self, secret: object, keys: Any, namespace: Any = None) -> int:
        tenant = self._tenant(secret).name
        check_request(keys, namespace)
        self.counters["exists_calls"] += 1
        return self.store.exists(keys, namespace=namespace, tenant=tenant)

    def probe(self, secret: object, keys: Any, namespace: Any = None) -> Probe:
        tenant = self._tenant(secret).name
        check_request(keys, namespace)
        self.counters["exists_calls"] += 1
        return self.store.probe(keys, namespace=namespace, tenant=tenant)

    def gvas(self, secret: object, keys: Any, namespace: Any = None) -> np.ndarray:
        tenant = self._tenant(secret).name
        check_request(keys, namespace)
        return self.store.gvas(keys, namespace=namespace, tenant=tenant)

    def release(self, secret: object, lease_id: object, bad_scopes: Any = ()) -> bool:
        """True when the caller's tenant held this lease and every scope it pinned is intact:
        what its reader read is good. Anything else (unknown, expired, another tenant's) is
        False, counted, and changes nothing."""
        tenant = self._tenant(secret, metered=False).name
        failpoint("node.release", lease_id=lease_id)
        return self._release(tenant, lease_id, scope_ids(bad_scopes))

    def _release(self, tenant: str, lease_id: object, bad_scopes: Iterable[int] = ()) -> bool:
        self.counters["releases"] += 1
        lease = self.leases.pop(lease_id, tenant)
        if lease is None:
            self.counters["lease_misses"] += 1
            return False
        bad = set(lease.scope_ids).intersection(bad_scopes)
        if bad:
            # A reader saw a bad checksum: read those scopes here, so the store's own check
            # quarantines them if the medium really is bad (a torn remote read does not). The
            # reader has already dropped those pages; the rest of what it read is good.
            self.store.recheck(lease, bad)
            return True
        intact = self.store.release(lease)
        self.counters["leases_broken"] += int(not intact)
        return intact

    def _expire_leases(self) -> None:
        for lease in self.leases.expire(time.monotonic()):
            self.store.release(lease)
