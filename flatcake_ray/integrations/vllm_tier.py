"""FlatCake-Ray as a secondary tier of vLLM's native KV offloading, turned on by one entry::

    kv_transfer_config={
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 8 << 30,
            "secondary_tiers": [
                {"type": "FlatCakeTier",
                 "module_path": "flatcake_ray.integrations.vllm_tier",
                 "store": "ray", "ray_namespace": "flatcake"},
            ],
        },
    }

(:func:`tier_config` builds the entry, :func:`kv_transfer_config` the whole dict.) vLLM's
CPU tier stays the primary tier; FlatCake sits below it, next to or instead of vLLM's ``fs``
tier. Options are the connector's: ``store: ray`` attaches to the FlatCake-Ray service (any
replica, any node of the Ray cluster; ``ray_<field>`` sets a ClientConfig field), ``store:
local`` with ``store_root`` opens an in-process store (the tier runs in vLLM's scheduler
process only, so any executor works). ``namespace`` replaces the model name in the store's
namespace, ``locality`` (``LOCAL``/``REMOTE``) is what vLLM's tier filters see,
``tier_threads`` (4) run the transfers, ``load_timeout_s`` (300) bounds a promotion.

What moves: a chunk of vLLM's CPU tier (one row of its shared region: every layer and every
worker of ``blocks_per_chunk`` blocks) is one FlatCake page of ``layers`` layers (option,
default 1: the row split into equal layers), keyed by vLLM's offload key. A FlatCake service
serves one page geometry, so the service the tier attaches to has ``layers`` x
``page_bytes`` = the row's bytes; a mismatch is a typed error naming both.

- Lookups answer from the cluster's index off the scheduler thread (``_vllm_tier_parts``):
  ``lookup`` says RETRY until the step's batch is answered, as vLLM's ``fs`` tier does.
- Stores (cascades from the CPU tier) put the chunks in token order through FlatCake's put
  path: session scope from ``flatcake_session``, DRAM or SSD by the placement rule from the
  request's turn and context; chunks already stored are skipped (write-once).
- Loads (promotions into the CPU tier) restore through the restore engine straight into the
  CPU tier's rows (coalesced SSD reads, bounded window); a partial restore keeps its prefix.

Metrics: ``vllm:kv_offload_tiering_*`` from the job results, ``vllm:flatcake_tier_*`` from
:meth:`FlatCakeTier.get_stats`, and the store's own (``flatcake_*``) as every client's.
KV events (when vLLM publishes them): ``BlockStored`` with the placed medium and ownership
``flatcake``, ``BlockRemoved`` for announced chunks later found gone.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from flatcake_ray.errors import ConfigError, FlatCakeError
from flatcake_ray.integrations._common import (
    STORE_KIND,
    Geometry,
    make_namespace,
    open_store,
    release_store,
    warm_up,
)
from flatcake_ray.integrations._vllm_restore import RestoreSettings
from flatcake_ray.integrations._vllm_tier_parts import (
    IndexLookups,
    RequestFacts,
    TierCounters,
    TierEvents,
    in_token_order,
    metric_definitions,
)
from flatcake_ray.restore.dest import LayerTensors

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["MODULE_PATH", "TIER_TYPE", "FlatCakeTier", "kv_transfer_config", "tier_config"]

logger = logging.getLogger(__name__)

MODULE_PATH = __name__
TIER_TYPE = "FlatCakeTier"


def tier_config(**options: Any) -> dict[str, Any]:
    """The ``secondary_tiers`` entry that puts FlatCake-Ray below vLLM's CPU tier."""
    return {"type": TIER_TYPE, "module_path": MODULE_PATH, **options}


def kv_transfer_config(cpu_bytes_to_use: int, **options: Any) -> dict[str, Any]:
    """vLLM's native offloading (OffloadingConnector, TieringOffloadingSpec) with a CPU tier
    of ``cpu_bytes_to_use`` bytes and FlatCake-Ray below it."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": int(cpu_bytes_to_use),
            "secondary_tiers": [tier_config(**options)],
        },
    }


@dataclass(frozen=True)
class _Finished:
    result: JobResult
    missing: tuple[OffloadKey, ...] = ()  # a load's keys it could not deliver


class FlatCakeTier(SecondaryTierManager):
    """See the module docstring. Every method runs on vLLM's scheduler thread and returns
    at once; transfers run on the tier's threads and report through ``get_finished_jobs``."""

    medium: ClassVar[Medium] = Medium.STORAGE
    # Pages lie in FlatCake DRAM or SSD, on this node or another: no one vLLM source fits.
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        locality: str | None = None,
        layers: int = 1,
        tier_threads: int = 4,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        kind = str(options.get(STORE_KIND, "local"))
        self.locality = _locality(locality or ("REMOTE" if kind == "ray" else "LOCAL"))
        row_bytes = self.block_size_bytes
        if layers < 1 or row_bytes % layers:
            raise ConfigError(f"layers={layers!r} does not split a {row_bytes}-byte chunk")
        if tier_threads < 1:
            raise ConfigError(f"tier_threads must be >= 1, not {tier_threads!r}")
        page_bytes = row_bytes // layers
        self._store = open_store(options, Geometry(layers, page_bytes))
        warm_up(self._store)  # as the tier is made, not in its first store
        self.namespace = _namespace(offloading_spec, options.get("namespace"), row_bytes)
        self._timeout = RestoreSettings.from_options(options).load_timeout_s
        rows = torch.frombuffer(primary_kv_view, dtype=torch.uint8).view(-1, row_bytes)
        # Each layer of every row, as the restore engine's destination and the put's source;
        # they hold the CPU tier's region exported until ``shutdown`` lets go of them.
        self._layer_views = [rows[:, i * page_bytes : (i + 1) * page_bytes] for i in range(layers)]
        self.counters = TierCounters()
        events_on = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        self.events = TierEvents(events_on, self.locality)
        self._lookups = IndexLookups(
            tier_type, self._exists, self.counters, on_missing=self._withdraw
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(tier_threads, "flatcake_tier")
        self._inflight: dict[JobId, concurrent.futures.Future[None]] = {}
        self._finished: queue.SimpleQueue[_Finished] = queue.SimpleQueue()

    # ---- lookups ---------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def _exists(self, keys: list[OffloadKey]) -> int:
        return self._store.exists(keys, namespace=self.namespace)

    def _withdraw(self, keys: Iterable[OffloadKey]) -> None:
        self.counters.add(withdrawn_blocks=self.events.withdraw(keys))

    # ---- transfers -------------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        facts = RequestFacts.of(job_metadata.req_context)  # on this thread: vLLM's context
        self._submit(job_metadata, self._store_job, facts)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._load_job)

    def _submit(self, job: TransferJob, work: Any, *args: Any) -> None:
        self._inflight[job.job_id] = self._pool.submit(self._run, job, work, *args)

    def _run(self, job: TransferJob, work: Any, *args: Any) -> None:
        """One job on a tier thread; it always reports, since a job vLLM never hears of keeps
        its CPU-tier chunks pinned for good. FlatCake's typed errors are the expected
        failures (medium full, service gone); anything else is logged with its traceback."""
        started = time.monotonic()
        try:
            finished = work(job, started, *args)
        except FlatCakeError as exc:
            logger.warning("FlatCake tier job %d failed: %s", job.job_id, exc)
            finished = self._failed(job, started)
        except Exception:
            logger.exception("FlatCake tier job %d failed", job.job_id)
            finished = self._failed(job, started)
        self._finished.put(finished)

    def _failed(self, job: TransferJob, started: float) -> _Finished:
        result = JobResult(job.job_id, False, transfer_time=time.monotonic() - started)
        if job.is_promotion:
            self.counters.add(failed_load_blocks=len(job.keys))
            return _Finished(result, tuple(job.keys))
        self.counters.add(failed_stores=1)
        return _Finished(result)

    def _store_job(self, job: TransferJob, started: float, facts: RequestFacts) -> _Finished:
        keys = list(job.keys)
        order = in_token_order(keys, job.req_context)
        keys = [keys[i] for i in order]
        chunks = torch.as_tensor([int(job.chunk_ids[i]) for i in order], dtype=torch.long)
        last = job.req_context.get_offload_key_position(keys[-1])
        with self._store.begin_put(
            keys,
            namespace=self.namespace,
            session_id=facts.session_id,
            hints=facts.hints(last),
        ) as handle:
            for layer, view in enumerate(self._layer_views):
                handle.write_layer(layer, view.index_select(0, chunks).numpy())
            put = handle.commit()
        self.events.stored(keys, put.medium)
        written = put.pages_written
        self.counters.add(stored_blocks=written, skipped_blocks=put.pages_skipped)
        if put.medium is not None:
            self.counters.add(**{f"stored_{put.medium.name.lower()}_blocks": written})
        return _Finished(
            JobResult(
                job.job_id,
                True,
                transfer_time=time.monotonic() - started,
                transfer_bytes=written * self.block_size_bytes,
            )
        )

    def _load_job(self, job: TransferJob, started: float) -> _Finished:
        keys = list(job.keys)
        dest = LayerTensors(self._layer_views, [int(chunk) for chunk in job.chunk_ids])
        restored = self._store.restore(keys, dest, namespace=self.namespace).wait(self._timeout)
        missing = tuple(keys[restored:])
        self.counters.add(loaded_blocks=restored, failed_load_blocks=len(missing))
        result = JobResult(
            job.job_id,
            not missing,
            # A partial restore delivered a prefix of the job's keys: vLLM keeps those.
            successful_keys=tuple(keys[:restored]) if missing and restored else None,
            transfer_time=time.monotonic() - started,
            transfer_bytes=restored * self.block_size_bytes,
        )
        return _Finished(result, missing)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while True:
            try:
                finished = self._finished.get_nowait()
            except queue.Empty:
                return results
            self._inflight.pop(finished.result.job_id, None)
            if finished.missing:
                # vLLM would promote them again next step and fail again: a miss from now.
                self._lookups.mark_miss(finished.missing)
                self._withdraw(finished.missing)
            results.append(finished.result)

    def has_pending_work(self) -> bool:
        return bool(self._inflight)

    def drain_jobs(self) -> None:
        concurrent.futures.wait(list(self._inflight.values()))

    # ---- requests, steps, observability ----------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        RequestFacts.of(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.events.take()

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    def get_stats(self) -> OffloadingConnectorStats | None:
        return self.counters.take(self.tier_type)

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        self._layer_views.clear()  # vLLM unmaps the CPU tier's region after this returns
        release_store(self._store)


def _locality(name: str) -> Locality:
    try:
        return Locality(name)
    except ValueError:
        known = [member.value for member in Locality]
        raise ConfigError(f"locality must be one of {known}, not {name!r}") from None


def _namespace(spec: OffloadingSpec, name: str | None, row_bytes: int) -> str:
    """What must match for a chunk's bytes to mean the same: model, KV dtype, tokens per
    chunk, parallel layout and the chunk's bytes."""
    config = spec.config
    parallel = config.parallel
    return make_namespace(
        "vllm-native",
        name or config.model.name,
        config.model.dtype,
        f"t{config.cache.tokens_per_hash}x{config.cache.blocks_per_chunk}",
        f"tp{parallel.tp_size}pp{parallel.pp_size}pcp{parallel.pcp_size}dcp{parallel.dcp_size}",
        f"r{row_bytes}",
    )
