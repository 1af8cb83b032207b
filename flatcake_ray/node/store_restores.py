"""The in-process store's restores, mixed into ``FlatCakeStore`` (which provides the
attributes declared below, ``source_for`` and ``_check_open``): one restore pipeline per
tenant and device, and the calls that restore through it.

Apart from ``store.py`` because restores meet the store only at its sources and its counters:
the pipeline reads through a tenant's :class:`~flatcake_ray.node.source.NodeSource` and the
store's :class:`~flatcake_ray.node.read_ledger.ReadLedger` accounts for what it found, while
the store itself keeps the writes, the catalog's lookups and leases, and its lifecycle.

The pipeline and the destinations (torch) load with the first restore: a storage node's store
restores only to re-check a scope a remote reader found bad, and a node that never does
starts about a second sooner and ~190 MiB smaller without torch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from flatcake_ray.config import StoreConfig
from flatcake_ray.core.catalog import Lease
from flatcake_ray.core.keys import KeyLike, PageKey
from flatcake_ray.core.parts import lease_parts
from flatcake_ray.core.tenants import DEFAULT_TENANT
from flatcake_ray.cuda_ext.layouts import LAYER_FIRST, Layout
from flatcake_ray.errors import LeaseError
from flatcake_ray.media.arena import DramArena
from flatcake_ray.node.read_ledger import ReadLedger
from flatcake_ray.node.source import NodeSource
from flatcake_ray.node.tenancy import Tenancy
from flatcake_ray.restore.source import Leased

if TYPE_CHECKING:
    import torch

    from flatcake_ray.restore.pipeline import RestorePipeline

__all__ = ["RestoreCalls"]

Keys = Sequence[KeyLike | PageKey]


class RestoreCalls:
    config: StoreConfig
    tenancy: Tenancy
    reads: ReadLedger
    counters: dict[str, int]
    arena: DramArena
    _lock: threading.RLock
    _pipelines: dict[tuple[str, torch.device], RestorePipeline]

    def source_for(self, tenant: str) -> NodeSource:
        raise NotImplementedError

    def _check_open(self) -> None:
        raise NotImplementedError

    def pipeline(
        self, device: str | torch.device = "cpu", tenant: str = DEFAULT_TENANT
    ) -> RestorePipeline:
        """The store's restore pipeline for ``tenant``'s destinations on ``device`` (made on
        first use)."""
        import torch

        from flatcake_ray.restore.pipeline import RestorePipeline

        key = (tenant, torch.device(device))
        if key[1].type == "cuda" and key not in self._pipelines:
            # Once per pipeline, off the store's lock: torch is loaded now, and page-locked,
            # the arena's copies to the GPU are DMA.
            self.arena.register_with_cuda()
        source = self.source_for(tenant)
        with self._lock:
            self._check_open()
            if key not in self._pipelines:
                self._pipelines[key] = RestorePipeline(
                    source,
                    windows=self.config.restore_windows,
                    slot_bytes=self.config.restore_slot_bytes,
                    device=key[1],
                )
            return self._pipelines[key]

    def restore(
        self,
        keys: Keys,
        dest: Any,
        slot_ids: Any = None,
        layout: Layout = LAYER_FIRST,
        *,
        namespace: str | None = None,
        grant: Any = None,
        tenant: str = DEFAULT_TENANT,
    ):
        """Start a layer-pipelined restore of ``keys`` into ``dest``; see ``RestorePipeline``.
        This store hands out no grants: a ``grant`` is another store's (LeaseError)."""
        from flatcake_ray.restore.dest import as_destination

        destination = as_destination(dest, slot_ids, layout)
        pipeline = self.pipeline(destination.device, tenant)
        return pipeline.submit(keys, destination, namespace=namespace, grant=grant)

    def let_go(self, grant: Any) -> None:
        """No grant is this store's (``probe`` hands out none)."""
        raise LeaseError(f"an in-process store hands out no lease grants, got {grant!r}")

    def get(
        self, keys: Keys, out: Any, *, namespace: str | None = None, tenant: str = DEFAULT_TENANT
    ) -> int:
        """Restore the consecutive hits into ``out`` (``[layers, >= len(keys), page_elems]``,
        numpy or torch) and return how many pages from the first are valid."""
        from flatcake_ray.restore.dest import PagedPool

        self._check_open()
        pool = PagedPool(out, np.arange(len(keys)), LAYER_FIRST)
        pipeline = self.pipeline(pool.device, tenant)
        restored = pipeline.submit(keys, pool, namespace=namespace).wait()
        with self._lock:
            self.counters["gets"] += 1
            self.counters["miss_pages"] += len(keys) - restored
        return restored

    def restore_lease(self, lease: Lease, dest: Any):
        """Restore a prefix leased with :meth:`lease` into ``dest``; the restore takes the
        lease over and releases it when it ends."""
        leased = Leased(lease.hits, lease_parts(lease), lease)
        return self.pipeline(dest.device, lease.tenant).submit_leased(leased, dest)

    def recheck(self, lease: Lease, scope_ids: set[int]) -> None:
        """Read the leased pages of ``scope_ids`` again here, every block checked (a remote
        reader saw a bad one; ``ReadLedger.recheck``). Consumes the lease."""
        catalog, pipeline = self.tenancy.catalog(lease.tenant), self.pipeline("cpu", lease.tenant)
        self.reads.recheck(lease, scope_ids, catalog, pipeline)
