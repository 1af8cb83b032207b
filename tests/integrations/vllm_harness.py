"""A vLLM engine on CPU without a model: the real Scheduler, the real KV allocation, and the
worker-side call sequence of vLLM's model runner around a stand-in forward pass.

What is vLLM's own code: ModelConfig/VllmConfig, the KV cache planning of the engine core
(``get_kv_cache_configs``, ``resolve_kv_cache_layout``), ``Scheduler`` (which builds the
scheduler-side connector itself through ``KVConnectorFactory``), ``allocate_kv_cache`` (the
paged KV tensors), ``set_forward_context`` and the request block hasher. What stands in: the
forward pass. It writes, per token, KV bytes that depend on the whole prefix up to that token
(as attention KV does), so a restored block is right only if it holds exactly those bytes.
"""

from __future__ import annotations

import copy
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

BLOCK = 32  # the CPU attention backend takes multiples of 32
LAYERS = 3
KV_HEADS = 2
HEAD = 32
NUM_BLOCKS = 96
EOS = 2
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
PAGE_BYTES = 2 * KV_HEADS * BLOCK * HEAD * 2  # K and V of one block of one layer, bfloat16


def model_config(folder: str) -> ModelConfig:
    """A tiny Llama described by a local config.json: no weights, no tokenizer, no hub."""
    return ModelConfig(
        model=folder, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024, seed=0
    )


def build_vllm_config(
    base: ModelConfig,
    extra_config: dict[str, Any],
    kv_load_failure_policy: str = "fail",
    hash_algo: str = "sha256",
    kv_events: KVEventsConfig | None = None,
) -> VllmConfig:
    return VllmConfig(
        model_config=copy.deepcopy(base),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=256,
            max_model_len=1024,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        cache_config=CacheConfig(
            block_size=BLOCK, enable_prefix_caching=True, prefix_caching_hash_algo=hash_algo
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="FlatCakeConnector",
            kv_connector_module_path="flatcake_ray.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra_config,
            kv_load_failure_policy=kv_load_failure_policy,
        ),
        device_config=DeviceConfig("cpu"),
        kv_events_config=kv_events,
    )


def _plan_kv_caches(vllm_config: VllmConfig):
    """What EngineCore._initialize_kv_caches does, for one CPU worker."""
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16
    )
    specs = [dict.fromkeys(LAYER_NAMES, spec)]
    layout = resolve_kv_cache_layout(vllm_config, [["LBHNC"]], list(specs[0].values()))
    groups = get_global_kv_cache_groups(vllm_config, specs)
    memory = [NUM_BLOCKS * LAYERS * spec.page_size_bytes]
    worker_configs = get_kv_cache_configs(vllm_config, specs, memory, groups)
    for config in worker_configs:
        config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    scheduler_config = generate_scheduler_kv_cache_config(worker_configs)
    vllm_config.cache_config.num_gpu_blocks = scheduler_config.num_blocks
    block_size, hash_block = resolve_kv_cache_block_sizes(scheduler_config, vllm_config)
    for config in (*worker_configs, scheduler_config):
        config.hash_block_size = hash_block
    return layout, worker_configs[0], scheduler_config, block_size, hash_block


def prefix_kv(tokens: list[int], position: int) -> torch.Tensor:
    """The stand-in model's KV of one token: [layers, heads, 2 * head] bf16, a function of
    the prefix ``tokens[: position + 1]``."""
    digest = hashlib.blake2b(repr(tokens[: position + 1]).encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    return torch.randn(LAYERS, KV_HEADS, 2 * HEAD, generator=generator).to(torch.bfloat16)


def next_token(tokens: list[int]) -> int:
    return 10 + (sum(tokens) * 31 + len(tokens)) % 900  # never EOS


@dataclass
class Engine:
    """One vLLM instance: scheduler process and one worker, in this process."""

    vllm_config: VllmConfig
    scheduler: Scheduler
    worker: Any  # FlatCakeConnector, worker role
    kv_caches: dict[str, torch.Tensor]
    hash_block: int
    events: list[str] = field(default_factory=list)
    computed_tokens: dict[str, int] = field(default_factory=dict)
    block_tables: dict[str, list[int]] = field(default_factory=dict)  # last seen per request
    connector_stats: list[dict[str, Any]] = field(default_factory=list)  # per step, as shipped

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add_request(
        self, req_id: str, prompt: list[int], max_tokens: int, cache_salt: str | None = None
    ) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            cache_salt=cache_salt,
            block_hasher=get_request_block_hasher(self.hash_block, sha256),
        )
        self.scheduler.add_request(request)
        return request

    def block_bytes(self, req_id: str, count: int) -> list[torch.Tensor]:
        """Bytes of the request's first ``count`` blocks in every layer (after it finished
        too: freed blocks keep their bytes until another request takes them)."""
        index = torch.tensor(self.block_tables[req_id][:count], dtype=torch.long)
        return [self.kv_caches[name][index].view(torch.uint8).clone() for name in LAYER_NAMES]

    # ---- one engine step ---------------------------------------------------------------
    def step(self) -> dict[str, list[int]]:
        output = self.scheduler.schedule()
        work = self._scheduled_work(output)
        self.worker.bind_connector_metadata(output.kv_connector_metadata)
        with set_forward_context(None, self.vllm_config):
            if output.has_sync_kv_loads:
                self.worker.start_load_kv(get_forward_context())
            for layer, name in enumerate(LAYER_NAMES):
                self.worker.wait_for_layer_load(name)
                self._forward_layer(layer, work)
                self.worker.save_kv_layer(name, self.kv_caches[name], None)
            if not output.has_sync_kv_loads:
                self.worker.start_load_kv(get_forward_context())
            self.worker.wait_for_save()
            results = self.worker.get_transfer_results(output.finished_req_ids)
            invalid = self.worker.get_block_ids_with_load_errors()
            stats = self.worker.get_kv_connector_stats()
            kv_events = self.worker.get_kv_connector_kv_cache_events()
        self.worker.clear_connector_metadata()
        if results.finished_recving:
            self.events.append(f"finished_recving:{sorted(results.finished_recving)}")
        sampled = self._sample(work)
        runner_output = ModelRunnerOutput(
            req_ids=list(sampled),
            req_id_to_index={req_id: i for i, req_id in enumerate(sampled)},
            sampled_token_ids=[sampled[req_id] for req_id in sampled],
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                invalid_block_ids=invalid,
                kv_connector_stats=stats,
                kv_cache_events=kv_events,
            ),
        )
        for outputs in self.scheduler.update_from_output(output, runner_output).values():
            if outputs.scheduler_stats and outputs.scheduler_stats.kv_connector_stats:
                self.connector_stats.append(outputs.scheduler_stats.kv_connector_stats)
        return sampled

    def _scheduled_work(self, output: Any) -> list[tuple[str, int, int]]:
        """(request, first position, tokens) computed by this step's forward."""
        work = [
            (new.req_id, new.num_computed_tokens, output.num_scheduled_tokens[new.req_id])
            for new in output.scheduled_new_reqs
        ]
        cached = output.scheduled_cached_reqs
        work += [
            (req_id, cached.num_computed_tokens[i], output.num_scheduled_tokens[req_id])
            for i, req_id in enumerate(cached.req_ids)
        ]
        for req_id, start, count in work:
            self.events.append(f"forward:{req_id}:{start}+{count}")
            self.computed_tokens[req_id] = self.computed_tokens.get(req_id, 0) + count
        return work

    def _forward_layer(self, layer: int, work: list[tuple[str, int, int]]) -> None:
        for req_id, start, count in work:
            request = self.scheduler.requests[req_id]
            tokens = list(request.all_token_ids)
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            self.block_tables[req_id] = list(block_ids)
            cache = self.kv_caches[LAYER_NAMES[layer]]  # [blocks, heads, block, 2*head]
            for position in range(start, start + count):
                block, offset = divmod(position, BLOCK)
                cache[block_ids[block], :, offset] = prefix_kv(tokens, position)[layer]

    def _sample(self, work: list[tuple[str, int, int]]) -> dict[str, list[int]]:
        sampled: dict[str, list[int]] = {}
        for req_id, start, count in work:
            request = self.scheduler.requests[req_id]
            done = start + count >= request.num_tokens
            sampled[req_id] = [next_token(list(request.all_token_ids))] if done else []
        return sampled

    def shutdown(self) -> None:
        """What vLLM does at exit: both connectors shut down and let go of their stores, and
        the KV-event publisher stops."""
        self.worker.shutdown()
        self.connector.shutdown()
        self.scheduler.kv_event_publisher.shutdown()

    def run(self, request: Request, max_steps: int = 200) -> list[int]:
        """Step until ``request`` finished; its output tokens."""
        for _ in range(max_steps):
            if request.is_finished():
                return list(request.output_token_ids)
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.events.append(f"waiting_for_remote_kvs:{request.request_id}")
                time.sleep(0.005)  # the load runs on the connector's loader thread
            self.step()
        raise AssertionError(f"{request.request_id} did not finish in {max_steps} steps")


BUILT: list[Engine] = []  # every engine built, for shutdown_engines()


def shutdown_engines() -> None:
    """Shut down every engine built so far (before their stores close)."""
    while BUILT:
        BUILT.pop().shutdown()


def build_engine(base: ModelConfig, extra_config: dict[str, Any], **config: Any) -> Engine:
    vllm_config = build_vllm_config(base, extra_config, **config)
    layout, worker_config, scheduler_kv_config, block_size, hash_block = _plan_kv_caches(
        vllm_config
    )
    init_none_hash(sha256)
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=scheduler_kv_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block,
        log_stats=True,
    )
    worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, worker_config)
    kv_caches = allocate_kv_cache(worker_config, torch.device("cpu"), layout, [BLOCK])
    worker.register_kv_caches(kv_caches)
    BUILT.append(Engine(vllm_config, scheduler, worker, kv_caches, hash_block))
    return BUILT[-1]
