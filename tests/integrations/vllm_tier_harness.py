"""vLLM's native offloading manager, scheduler side, as its connector drives it: a real
``TieringOffloadingSpec`` (CPU primary tier on a shared-memory region, secondary tiers made by
``SecondaryTierFactory`` from the config) with the engine's calls in their order. The one
thing missing is the GPU: the harness writes a stored chunk's bytes into the CPU tier's row
itself (what the offloading worker's GPU->CPU copy does) and reads a loaded one from there."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from flatcake_ray.integrations.vllm_tier import FlatCakeTier

BLOCK = 16  # tokens per block (one block per chunk)
WORKER_BLOCK_BYTES = 4096  # KV bytes of one block on the one worker: a chunk's row
CHUNKS = 16  # the CPU tier's rows
SETTLE_S = 120.0  # a loaded machine's longest wait for a tier job


def chunk_keys(count: int, seed: str = "p") -> list[OffloadKey]:
    return [make_offload_key(f"{seed}-{i}".encode().ljust(32, b"."), 0) for i in range(count)]


def chunk_bytes(key: OffloadKey, size: int = WORKER_BLOCK_BYTES) -> np.ndarray:
    """A row's worth of bytes that only ``key`` has."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little") ^ len(key))
    return rng.integers(0, 256, size, dtype=np.uint8)


def offloading_config(
    tier: dict[str, Any],
    *,
    events: bool = False,
    block_bytes: int = WORKER_BLOCK_BYTES,
    chunks: int = CHUNKS,
) -> OffloadingConfig:
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": chunks * block_bytes,
        "secondary_tiers": [dict(tier)],
    }
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=f"fc-tier-{uuid.uuid4().hex[:10]}",
        model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


class NativeEngine:
    """One engine's offloading manager with one tier below its CPU tier (FlatCake's, or
    another of vLLM's for comparison: ``tier`` is then None)."""

    def __init__(self, tier: dict[str, Any], *, events: bool = False, **sizes: int) -> None:
        self.spec = TieringOffloadingSpec(offloading_config(tier, events=events, **sizes))
        self.manager = self.spec.get_manager()
        found = self.manager.secondary_tiers[0]
        self.tier = found if isinstance(found, FlatCakeTier) else None
        view = self.manager.primary_tier.get_kv_memoryview()
        self.rows = np.frombuffer(view, dtype=np.uint8).reshape(-1, view.strides[0])
        self.steps = 0  # the steps the last lookup took

    def request(self, req_id: str, keys: Sequence[OffloadKey], **params: Any) -> ReqContext:
        context = ReqContext(req_id=req_id, kv_transfer_params=params or None)
        for index, key in enumerate(keys):
            context.set_offload_key_position(key, (index + 1) * BLOCK)
        self.manager.on_new_request(context)
        return context

    def store(self, context: ReqContext, keys: Sequence[OffloadKey]) -> None:
        """The GPU->CPU store of ``keys`` finished: vLLM cascades them to FlatCake."""
        output = self.manager.prepare_store(list(keys), context)
        assert output is not None
        stored = list(output.keys_to_store)
        for key, chunk in zip(stored, output.store_spec.chunk_ids, strict=True):
            self.rows[int(chunk)] = chunk_bytes(key, self.rows.shape[1])
        self.manager.complete_store(stored, context)

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self) -> None:
        """Steps until no tier job is in flight."""
        deadline = time.monotonic() + SETTLE_S
        self.step()
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "the tier's jobs did not finish"
            time.sleep(0.01)
            self.step()

    def lookup(self, context: ReqContext, keys: Sequence[OffloadKey], step_s: float = 0.01) -> int:
        """The scheduler's prefix lookup, retried each step (``step_s`` apart) until final:
        how many chunks from the first are ready in the CPU tier (promoted from FlatCake when
        they were not). ``steps``: the steps it took."""
        deadline = time.monotonic() + SETTLE_S
        self.steps = 0
        while True:
            hits, final = 0, True
            for key in keys:
                result = self.manager.lookup(key, context)
                if result is LookupResult.MISS:
                    break
                if result is LookupResult.HIT:
                    hits += 1
                else:
                    final = False
            if final:
                return hits
            assert time.monotonic() < deadline, "the lookups did not settle"
            time.sleep(step_s)
            self.step()
            self.steps += 1

    def read(self, context: ReqContext, keys: Sequence[OffloadKey]) -> list[np.ndarray]:
        """The CPU->GPU load of ``keys``: their rows' bytes."""
        spec = self.manager.prepare_load(list(keys), context)
        got = [self.rows[int(chunk)].copy() for chunk in spec.chunk_ids]
        self.manager.complete_load(list(keys), context)
        return got

    def finish(self, context: ReqContext) -> None:
        self.manager.on_request_finished(context)

    def shutdown(self) -> None:
        del self.rows  # an exported view would keep vLLM from unmapping its region
        self.manager.shutdown()


class ShortHandle:
    """A restore that delivers one page less than it holds, as after a reclaimed scope."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.hits = handle.hits

    def wait(self, timeout: float | None = None) -> int:
        return max(self.handle.wait(timeout) - 1, 0)


class ShortReads:
    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def restore(self, keys: Any, dest: Any, *args: Any, **options: Any) -> ShortHandle:
        return ShortHandle(self.store.restore(keys, dest, *args, **options))
