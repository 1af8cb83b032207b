"""A store's stats: its counters and media use, summed over its tenants, and each tenant's."""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

from flatcake_ray.core.catalog import Catalog
from flatcake_ray.core.gva import Medium
from flatcake_ray.media.arena import DramArena
from flatcake_ray.media.pool import SsdPool
from flatcake_ray.node.manifest import Manifest
from flatcake_ray.node.puts import PutTable
from flatcake_ray.node.tenancy import Tenancy


class StoreParts(Protocol):
    """What the stats read of a store (:class:`~flatcake_ray.node.store.FlatCakeStore`)."""

    @property
    def tenancy(self) -> Tenancy: ...

    @property
    def counters(self) -> dict[str, int]: ...

    @property
    def manifest(self) -> Manifest: ...

    @property
    def puts(self) -> PutTable[Any]: ...

    @property
    def arena(self) -> DramArena: ...

    @property
    def pool(self) -> SsdPool: ...


STORE_COUNTERS = (
    *("puts", "gets", "ssd_read_commands", "ssd_bytes_read", "dram_bytes_read"),
    *("bytes_delivered", "ssd_bytes_written", "dram_bytes_written", "ssd_write_commands"),
    *("layers_landed", "hit_pages", "miss_pages", "checksum_failures", "write_failures"),
)
_GEOMETRY = ("layers", "page_bytes")
_REPLICA_COUNTERS = (  # DRAM read replicas (core/replicas.py)
    "replicas_written",
    "replicas_refused",
    "replica_scopes_dropped",
    "replica_bytes_dropped",
)


def tenant_stats(catalog: Catalog) -> dict[str, Any]:
    """One tenant's pages, scopes, use and quota per medium, placement rules and leases."""
    ssd_scopes = [s for s in catalog.scopes.values() if s.medium is Medium.SSD]
    index_bytes = catalog.index.nbytes + sum(s.digests.nbytes for s in catalog.segments.values())
    return {
        "layers": catalog.config.layers,
        "page_bytes": catalog.config.page_bytes,
        "pages_indexed": len(catalog.index),
        "index_bytes": index_bytes,
        "scopes": len(catalog.scopes),
        "sessions": len(catalog.sessions),
        "segments": len(catalog.segments),
        "dram_used": catalog.used[Medium.DRAM],
        "ssd_used": catalog.used[Medium.SSD],
        "ssd_reserved": sum(s.runs.reserved_bytes for s in ssd_scopes),
        "quota_dram": catalog.quota[Medium.DRAM],
        "quota_ssd": catalog.quota[Medium.SSD],
        "placement_rules": dict(catalog.rule_counts),
        "leases_open": len(catalog.leases),
        **catalog.counters,
    }


def store_stats(store: StoreParts) -> dict[str, Any]:
    tenants = {catalog.tenant: tenant_stats(catalog) for catalog in store.tenancy}
    summed: Counter[str] = Counter()
    for row in tenants.values():
        summed.update(
            {
                k: v
                for k, v in row.items()
                if isinstance(v, int) and not k.startswith("quota") and k not in _GEOMETRY
            }
        )
    rules: Counter[str] = Counter()
    for row in tenants.values():
        rules.update(row["placement_rules"])
    space = store.tenancy.space
    dram, ssd = space[Medium.DRAM], space[Medium.SSD]
    pages = summed["pages_indexed"]
    reserved = summed["ssd_reserved"]
    return {
        **store.counters,
        "chunks_renewed": store.arena.renewals,  # given a fresh file as they changed tenants
        **{k: summed[k] for k in ("reclaimed_scopes", "reclaimed_bytes", "quarantined_scopes")},
        "forks": summed["forks"],
        **{k: summed[k] for k in _REPLICA_COUNTERS},
        **store.manifest.report.counters(),
        "pages_indexed": pages,
        "index_bytes": summed["index_bytes"],
        "index_bytes_per_page": summed["index_bytes"] / pages if pages else 0.0,
        "scopes": summed["scopes"],
        "sessions": summed["sessions"],
        "segments": summed["segments"],
        "dram_capacity": dram.capacity,
        "dram_used": dram.capacity - dram.free_bytes,
        "ssd_capacity": ssd.capacity,
        "ssd_reserved": reserved,
        "ssd_used": summed["ssd_used"],
        "ssd_pool_utilisation": summed["ssd_used"] / reserved if reserved else 1.0,
        "placement_rules": dict(rules),
        "leases_open": summed["leases_open"],
        "puts_open": len(store.puts),
        "puts_expired": store.puts.expired,
        "arena_chunks": store.arena.chunks,  # each handed to its owner only
        "arena_hugepages": store.arena.huge,
        "ssd_o_direct": store.pool.direct,
        "ssd_prewrite_pending": store.pool.prewrite_pending,  # never-written bytes to go
        "ssd_prewrite_error": store.pool.prewrite_error,
        "ssd_prewrite_waited_s": store.pool.prewrite_waited_s,  # for an idle drive
        "tenants": tenants,
    }
