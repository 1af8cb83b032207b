"""FlatCake-Ray as an SGLang HiCache storage backend (L3), attached by configuration alone::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "flatcake",
        "module_path": "flatcake_ray.integrations.sglang",
        "class_name": "FlatCakeHiCacheStorage", "interface_v1": 1,
        "store": "ray", "ray_namespace": "flatcake"}'

SGLang builds the backend as ``cls(storage_config, kwargs)``, then registers its host pool
(``register_mem_pool_host``, ``on_host_pools_registered``); the store is opened then, when
the page geometry is known. With ``interface_v1`` SGLang calls the zero-copy
``batch_get_v1``/``batch_set_v1`` with host token indices; without it, ``batch_get``/
``batch_set`` with flat page tensors. Keys are SGLang's page hashes (chained prefix hashes, hex
strings); ``extra_info.prefix_keys`` names the page a batch continues, which the store uses to
find the session. For MLA (KV replicated on every TP rank) only the storage writer writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from flatcake_ray.core.api import KVStore
from flatcake_ray.errors import ConfigError, FlatCakeError
from flatcake_ray.integrations._common import make_namespace, open_store, release_store, warm_up
from flatcake_ray.integrations._sglang_layout import HostPoolView, host_pool_view
from flatcake_ray.restore.dest import LayerTensors

logger = logging.getLogger(__name__)

BACKEND_NAME = "flatcake"
MODULE_PATH = __name__
CLASS_NAME = "FlatCakeHiCacheStorage"


def extra_config(**store_options: Any) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` that selects this backend (as a dict)."""
    return {
        "backend_name": BACKEND_NAME,
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "interface_v1": 1,
        **store_options,
    }


@dataclass
class FlatCakeStorageMetrics:
    """The fields SGLang's StorageMetricsCollector reads (pages per call, GB/s per call);
    the collector may add attributes of its own."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


def _namespace(config: HiCacheStorageConfig, options: dict[str, Any]) -> str:
    shard = [f"pp{config.pp_rank}of{config.pp_size}"] if config.pp_size > 1 else []
    if config.attn_cp_size > 1:  # context-parallel ranks hold disjoint slices of a page
        shard.append(f"cp{config.attn_cp_rank}of{config.attn_cp_size}")
    if config.dcp_size > 1:
        shard.append(f"dcp{config.dcp_rank}of{config.dcp_size}")
    # Replicated (MLA) KV is one copy for all TP ranks; MHA heads are split across them.
    shard.insert(0, "mla" if config.is_mla_model else f"tp{config.tp_rank}of{config.tp_size}")
    model = options.get("namespace") or config.model_name or "model"
    return make_namespace("sglang", model, *shard)


class FlatCakeHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.options = dict(storage_config.extra_config or {})
        self.namespace = _namespace(storage_config, self.options)
        self.is_writer = storage_config.is_storage_writer
        self.store: KVStore | None = None
        self.view: HostPoolView | None = None
        self._metrics = FlatCakeStorageMetrics()
        self._collect = bool(storage_config.enable_storage_metrics)

    # ---- attach ----------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.view = host_pool_view(mem_pool_host, is_mla=self._pool_is_mla(mem_pool_host))

    def _pool_is_mla(self, pool: Any) -> bool:
        # MLA host pools keep one latent vector per token (no K/V axis); MHA ones have both.
        return hasattr(pool, "kv_lora_rank") or getattr(pool, "is_mla", False)

    def on_host_pools_registered(self) -> None:
        self.store = open_store(self.options, self._view().geometry)
        warm_up(self.store)  # as HiCache starts, not in its first backup

    def _view(self) -> HostPoolView:
        if self.view is None:
            raise ConfigError("no host pool registered (SGLang calls register_mem_pool_host)")
        return self.view

    def _store(self) -> KVStore:
        if self.store is None:
            self.on_host_pools_registered()
        assert self.store is not None
        return self.store

    # ---- lookups ---------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        return self._store().exists(keys, namespace=self.namespace)

    # ---- zero-copy interface (interface_v1) ------------------------------------------------
    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        view = self._view()
        started = time.perf_counter()
        dest = LayerTensors(view.layer_tensors(), view.page_ids(host_indices, len(keys)))
        restored = self._store().restore(list(keys), dest, namespace=self.namespace).wait()
        self._note(self._metrics.prefetch_pgs, self._metrics.prefetch_bandwidth, restored, started)
        return [i < restored for i in range(len(keys))]

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not self.is_writer:  # another rank writes the replicated copy
            return [True] * len(keys)
        view = self._view()
        started = time.perf_counter()
        page_ids = view.page_ids(host_indices, len(keys))
        layers = [view.gather_layer(layer, page_ids) for layer in range(view.geometry.layers)]
        stored = self._put(keys, layers, extra_info)
        self._note(self._metrics.backup_pgs, self._metrics.backup_bandwidth, len(keys), started)
        return [stored] * len(keys)

    # ---- flat-page interface ---------------------------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        view = self._view()
        pages = self._restore(keys)
        found: list[torch.Tensor | None] = []
        for i, target in enumerate(target_locations):
            if i >= pages.shape[1]:
                found.append(None)
                continue
            view.flat_to_canonical(target)[:, 0] = pages[:, i].view(
                view.pages.shape[0], *view.pages.shape[2:]
            )
            found.append(target)
        return found

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if not self.is_writer:
            return True
        view = self._view()
        pages = [
            view.flat_to_canonical(value)[:, 0].reshape(view.pages.shape[0], -1) for value in values
        ]
        return self._put(keys, list(torch.stack(pages, dim=1)), None)

    # ---- store calls -----------------------------------------------------------------------
    def _restore(self, keys: Sequence[str]) -> torch.Tensor:
        """uint8 [layers, restored, page_bytes]: the consecutive hits from the first key."""
        geometry = self._view().geometry
        out = torch.empty((geometry.layers, len(keys), geometry.page_bytes), dtype=torch.uint8)
        restored = self._store().get(list(keys), out, namespace=self.namespace)
        return out[:, :restored]

    def _put(
        self,
        keys: Sequence[str],
        layers: list[torch.Tensor],
        extra_info: HiCacheStorageExtraInfo | None,
    ) -> bool:
        """Layer by layer through the store's put path (``layers``: one ``[pages, page_bytes]``
        tensor per layer). False when the store cannot take the pages (full, write failed):
        SGLang then stops backing up this batch and serves on; the store's error is logged
        with its traceback."""
        prefix = extra_info.prefix_keys if extra_info is not None else None
        parent = prefix[-1] if prefix else None
        try:
            with self._store().begin_put(
                list(keys), namespace=self.namespace, parent=parent
            ) as put:
                for layer, pages in enumerate(layers):
                    put.write_layer(layer, pages)
                put.commit()
        except FlatCakeError:
            logger.warning("FlatCake backup of %d pages failed", len(keys), exc_info=True)
            return False
        return True

    def _note(self, pages: list[int], bandwidth: list[float], count: int, started: float) -> None:
        if not self._collect or not count:
            return
        seconds = max(time.perf_counter() - started, 1e-9)
        geometry = self._view().geometry
        pages.append(count)
        bandwidth.append(count * geometry.layers * geometry.page_bytes / seconds / 1e9)

    # ---- stats and lifecycle ---------------------------------------------------------------
    def get_stats(self) -> FlatCakeStorageMetrics | None:
        if not self._collect:
            return None
        metrics, self._metrics = self._metrics, FlatCakeStorageMetrics()
        return metrics

    def store_stats(self) -> dict[str, Any]:
        """The store's own counters (placement rules, media, coalesced reads)."""
        return self._store().stats()

    def clear(self) -> None:
        # A shared store outlives one engine: clearing it would drop other engines' pages.
        return None

    def close(self) -> None:
        # Each backend holds its own use of the store: an in-process store closes (arena
        # removed) with its last user, a Ray client at once.
        store, self.store = self.store, None
        if store is not None:
            release_store(store)
