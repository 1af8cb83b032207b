"""FlatCakeStore: one node's flat DRAM+SSD KV store, in process (a :class:`KVStore`).

The storage actor of the Ray service wraps one of these; engines on one box, tests and the
demo use it directly.

- ``begin_put(keys)`` -> :class:`PutHandle`: ``write_layer`` each layer, then ``commit``, so an
  engine saves as layers finish without buffering the context; ``put(keys, kv)`` does the
  same for a ``[layers, len(keys), page_elems]`` buffer. Stored keys are skipped (write-once);
  the rest become one layer-major segment on the medium placement picks, published after the
  bytes and their manifest record are written.
- ``exists(keys)`` / ``probe(keys)``: consecutive hits from the first key (and whether any is
  on SSD).
- ``restore(keys, dest)``: a layer-pipelined restore through the store's
  :class:`RestorePipeline` (one per device); ``get(keys, out)`` waits for one into a
  ``[layers, pages, page_elems]`` buffer and returns how many pages are valid. What restores
  found is counted, and bad scopes quarantined, by its :class:`ReadLedger` (``reads``). The
  restore calls are :class:`~flatcake_ray.node.store_restores.RestoreCalls` (mixed in).

One process owns a store root at a time (a lock file): a second opener gets
:class:`StoreInUseError` instead of allocating the same extents twice.

Tenants (``node/tenancy.py``): every call takes ``tenant=`` (default: the ``default`` tenant,
with the store's geometry); each tenant has its own catalog, geometry and quotas over the
shared media. A storage node registers the service's tenants with :meth:`set_tenant`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flatcake_ray.config import StoreConfig
from flatcake_ray.core.api import Probe, PutResult
from flatcake_ray.core.catalog import Catalog, Lease, PutHints, Scope
from flatcake_ray.core.extents import hand_over_vacated
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.gva import encode as encode_gva
from flatcake_ray.core.keys import (
    KeyLike,
    PageKey,
    check_key_list,
    key_digests,
    put_digests,
)
from flatcake_ray.core.put_checks import check_hints
from flatcake_ray.core.tenants import DEFAULT_TENANT, Tenant
from flatcake_ray.errors import ShapeError, StoreClosedError
from flatcake_ray.media.arena import ArenaChunk, DramArena
from flatcake_ray.media.buffers import as_page_bytes
from flatcake_ray.media.pool import SsdPool
from flatcake_ray.metrics.record import Metrics
from flatcake_ray.node.manifest import Manifest
from flatcake_ray.node.put import PutHandle
from flatcake_ray.node.puts import PutTable
from flatcake_ray.node.read_ledger import ReadLedger
from flatcake_ray.node.recovery import lock_root, manifest_header, recover
from flatcake_ray.node.source import NodeSource
from flatcake_ray.node.stats import STORE_COUNTERS, store_stats
from flatcake_ray.node.store_restores import RestoreCalls
from flatcake_ray.node.tenancy import Tenancy
from flatcake_ray.node.writer import SegmentWriter

if TYPE_CHECKING:  # torch loads with the first restore pipeline (store_restores.py)
    import torch

    from flatcake_ray.restore.pipeline import RestorePipeline

__all__ = ["FlatCakeStore", "PutHandle", "PutHints", "PutResult"]

Keys = Sequence[KeyLike | PageKey]


class FlatCakeStore(RestoreCalls):
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.tenancy = Tenancy(config, on_free=self._log_free)
        self.counters = dict.fromkeys(STORE_COUNTERS, 0)
        self.metrics = Metrics(node_id=config.node_id, page_tokens=config.placement.page_tokens)
        self._lock = threading.RLock()
        self._closed = False
        self._pipelines: dict[tuple[str, torch.device], RestorePipeline] = {}
        self._sources: dict[str, NodeSource] = {}
        self.puts: PutTable[PutHandle] = PutTable(config.put_ttl_s)
        with ExitStack() as undo:  # a failed open leaves no fd, arena or lock behind
            self._lock_fd = lock_root(Path(config.root))
            undo.callback(os.close, self._lock_fd)
            root_slug = Path(config.root).resolve().as_posix().strip("/").replace("/", "-")
            chunk = config.dram_chunk_bytes if config.dram_chunks > 1 else 0
            self.arena = DramArena(
                config.dram_bytes, f"{root_slug}-{config.node_id}", config.hugepages, chunk
            )
            undo.callback(self.arena.close)
            self.pool = SsdPool(
                config.ssd_folders,
                config.ssd_files_per_dir,
                config.ssd_file_bytes,
                prewrite=config.ssd_prewrite,
                prewrite_paced=config.ssd_prewrite_paced,
            )
            undo.callback(self.pool.close)
            self.manifest = Manifest(
                str(Path(config.ssd_folders[0]) / "manifest.fcm"),
                manifest_header(config, self.pool),
                config.fsync,
            )
            undo.callback(self.manifest.close)
            recover(self.manifest, self.tenancy, self.catalog)
            undo.pop_all()
        self.reads = ReadLedger(self._lock, self.counters, self.manifest)
        # A chunk going to another tenant gets a fresh file first (docs/security.md).
        self.tenancy.space[Medium.DRAM].on_handover = self.arena.renew_chunk
        self.writer = SegmentWriter(
            self._lock,
            self.arena,
            self.pool,
            self.manifest,
            self.counters,
            fsync=config.fsync,
            check_open=self._check_open,
            check_landed=not config.verify_dram,
        )

    @property
    def catalog(self) -> Catalog:
        """The default tenant's catalog (the whole store, for a single-tenant user)."""
        return self.tenancy.catalog(DEFAULT_TENANT)

    @property
    def source(self) -> NodeSource:
        """The default tenant's restore source (see :meth:`source_for`)."""
        return self.source_for(DEFAULT_TENANT)

    def arena_chunks(self, tenant: str) -> tuple[ArenaChunk, ...]:
        """The arena chunks ``tenant``'s pages may be in now: the chunks it holds on a
        partitioned arena, the whole arena on one of a single chunk."""
        with self._lock:
            regions = self.tenancy.space[Medium.DRAM].regions_of(tenant)
            return tuple(self.arena.chunk(region) for region in regions)

    def source_for(self, tenant: str) -> NodeSource:
        with self._lock:
            if tenant not in self._sources:
                self._sources[tenant] = NodeSource(self, self.tenancy.catalog(tenant))
            return self._sources[tenant]

    def hand_over_vacated(self) -> int:
        """Give every arena chunk its tenant left empty a fresh file now, off the store's
        lock (a storage node does before each report): the next tenant to take one then pays
        nothing under the lock (128 MiB: 51 ms, ``BENCHMARKS.md``). Returns how many."""
        space = self.tenancy.space[Medium.DRAM]
        return hand_over_vacated(space, self._lock, self.arena.renew_chunk)

    def set_tenant(self, tenant: Tenant) -> None:
        """Register (or update the quotas of) a tenant of the service."""
        with self._lock:
            self.tenancy.set_tenant(tenant)

    @property
    def layers(self) -> int:
        return self.config.layers

    @property
    def page_bytes(self) -> int:
        return self.config.page_bytes

    # ---- lifecycle -----------------------------------------------------------------------
    def _log_free(self, scope: Scope) -> None:
        if scope.medium is Medium.SSD:
            self.manifest.append({"t": "free", "scope": scope.scope_id})

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pipelines = list(self._pipelines.values())
        for pipeline in pipelines:
            pipeline.close()
        self.puts.abort_all()
        self.writer.close()
        for source in self._sources.values():
            source.close()
        self.manifest.close()
        self.pool.close()
        self.arena.close()
        os.close(self._lock_fd)  # closing the descriptor releases its flock

    def __enter__(self) -> FlatCakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    # ---- writes --------------------------------------------------------------------------
    def begin_put(
        self,
        keys: Keys,
        *,
        namespace: str | None = None,
        session_id: str | None = None,
        parent: KeyLike | PageKey | np.ndarray | None = None,
        hints: PutHints | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> PutHandle:
        self._check_open()
        check_key_list(keys)
        if len(keys) == 0:
            raise ShapeError("a put needs at least one key")
        check_hints(hints)
        digests, parent_digest = put_digests(keys, namespace, parent)
        self.puts.expire(time.monotonic())
        with self._lock:
            self._check_open()
            catalog = self.tenancy.catalog(tenant)
            plan = catalog.plan_put(
                digests, session_id=session_id, parent=parent_digest, hints=hints
            )
        page_all_layers = catalog.config.layers * catalog.config.page_bytes
        on_commit = partial(self.metrics.put_committed, tenant, page_all_layers)
        return PutHandle(self.writer, plan, catalog, len(keys), self.puts, on_commit)

    def warm_up(self, *, peers: bool = True) -> None:
        """Nothing to pay: the arena and the drive are this process's own, mapped when made
        (and it has no peers)."""

    def put(self, keys: Keys, kv: Any, **options: Any) -> PutResult:
        check_key_list(keys)
        if len(keys) == 0:  # before the kv's shape check, whose message would mislead
            raise ShapeError("a put needs at least one key")
        config = self.tenancy.catalog(options.get("tenant", DEFAULT_TENANT)).config
        pages, _ = as_page_bytes(
            kv, config.layers, config.page_bytes, min_pages=len(keys), writable=False, what="kv"
        )
        if pages.shape[1] != len(keys):
            raise ShapeError(f"kv holds {pages.shape[1]} pages for {len(keys)} keys")
        with self.begin_put(keys, **options) as handle:
            for layer in range(config.layers):
                handle.write_pages(layer, 0, np.ascontiguousarray(pages[layer]))
            return handle.commit()

    # ---- reads ---------------------------------------------------------------------------
    def exists(
        self, keys: Keys, *, namespace: str | None = None, tenant: str = DEFAULT_TENANT
    ) -> int:
        self._check_open()
        digests = key_digests(keys, namespace)
        with self._lock:
            hits = self.tenancy.catalog(tenant).index.prefix_length(digests)
        self.metrics.probed(tenant, len(keys), hits)
        return hits

    def probe(
        self,
        keys: Keys,
        *,
        namespace: str | None = None,
        lease: bool = False,
        tenant: str = DEFAULT_TENANT,
    ) -> Probe:
        """The hits, and whether reading them touches SSD: where a lease would read them
        (a DRAM read replica of an SSD segment is a DRAM hit), so an engine's choice between
        loading inside the step and in the background follows the read, not the home.
        No grant, even with ``lease``: a restore's own lookup here costs no call."""
        digests = key_digests(keys, namespace)
        with self._lock:
            catalog = self.tenancy.catalog(tenant)
            segment_ids, _ = catalog.prefix(digests)
            on_ssd = catalog.reads_ssd(segment_ids)
        self.metrics.probed(tenant, len(keys), len(segment_ids))
        return Probe(len(segment_ids), on_ssd)

    def lease(
        self, keys: Keys, *, namespace: str | None = None, tenant: str = DEFAULT_TENANT
    ) -> Lease:
        """Locate the consecutive hits and pin their scopes; pair with :meth:`release`."""
        self._check_open()
        self.puts.expire(time.monotonic())
        digests = key_digests(keys, namespace)
        with self._lock:
            return self.tenancy.catalog(tenant).lease(digests)

    def release(self, lease: Lease) -> bool:
        """Let go of ``lease``; True when every scope it pinned is still the one it pinned
        (scope ids are never reused), so what its reader copied meanwhile is good. False
        means a scope went while leased (its tenant was removed, or a bug freed it): the
        reader must drop what it read (the seqlock-style check after the copy)."""
        with self._lock:
            if lease.tenant not in self.tenancy:
                return False
            catalog = self.tenancy.catalog(lease.tenant)
            intact = all(scope_id in catalog.scopes for scope_id in lease.scope_ids)
            catalog.release(lease)
            return intact

    def lease_runs(self, lease: Lease, medium: Medium) -> list[tuple[int, int]]:
        """The ``[start, end)`` spans on ``medium`` of the runs of ``lease``'s scopes, each
        to the end of its used bytes rounded up to the read alignment: what a reader of the
        lease may ask the node to read for it."""
        with self._lock:
            return self.tenancy.lease_runs(lease, medium)

    def remove_tenant(self, name: str) -> int:
        """Free every page of tenant ``name`` (removed from the service); returns the bytes
        freed. Its open puts are aborted; its leases must have been dropped."""
        self.puts.abort_tenant(name)
        with self._lock:
            self._sources.pop(name, None)
            return self.tenancy.remove(name)

    def gvas(
        self, keys: Keys, *, namespace: str | None = None, tenant: str = DEFAULT_TENANT
    ) -> np.ndarray:
        """The layer-0 GVA of each consecutive hit (per-layer GVAs follow the layout)."""
        digests = key_digests(keys, namespace)
        with self._lock:
            catalog = self.tenancy.catalog(tenant)
            segment_ids, pages = catalog.prefix(digests)
            out = np.empty(len(pages), dtype=np.uint64)
            for i, (segment_id, page) in enumerate(zip(segment_ids, pages, strict=True)):
                segment = catalog.segments[int(segment_id)]
                offset = segment.offset + int(page) * segment.layout.page_bytes
                out[i] = encode_gva(segment.medium, self.config.node_id, offset)
        return out

    # ---- stats ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters and use, summed over tenants, with each tenant's own under ``tenants``."""
        with self._lock:
            stats = store_stats(self)
            scopes = [scope for catalog in self.tenancy for scope in catalog.scopes.values()]
            self.metrics.node_state(stats, scopes)
        return {**stats, "metrics": self.metrics.snapshot()}
