"""Running vLLM's offline engine on the tiny model, and comparing what it produced."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

BLOCK = 32  # vLLM's CPU attention backend takes block sizes in multiples of 32
MAX_TOKENS = 6
TOP_LOGPROBS = 2


def engine_args(model: str, **overrides: Any) -> dict[str, Any]:
    """vLLM engine arguments for the tiny model on 1-2 CPU threads: eager (no torch.compile,
    which costs minutes), a fixed KV pool (the CPU backend otherwise reserves a fraction of
    the machine's memory), no tokenizer (prompts are token ids)."""
    args: dict[str, Any] = {
        "model": model,
        "dtype": "bfloat16",
        "block_size": BLOCK,
        "max_model_len": 2048,
        "max_num_seqs": 4,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.05,  # on CPU: the share of RAM vLLM checks is free
        "kv_cache_memory_bytes": 32 << 20,
        "seed": 0,
        "skip_tokenizer_init": True,
        "disable_log_stats": True,
    }
    args.update(overrides)
    return args


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    # per generated token: (token id, logprob as float.hex) of the sampled and top tokens
    logprobs: tuple[tuple[tuple[int, str], ...], ...]
    cached_tokens: int


def sampling(kv_params: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_params} if kv_params else None
    return SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=TOP_LOGPROBS,
        detokenize=False,
        ignore_eos=True,
        extra_args=extra,
    )


def completion_of(output: Any) -> Completion:
    sample = output.outputs[0]
    logprobs = tuple(
        tuple(sorted((int(token), float(entry.logprob).hex()) for token, entry in step.items()))
        for step in sample.logprobs
    )
    return Completion(tuple(sample.token_ids), logprobs, int(output.num_cached_tokens or 0))


def generate(llm: Any, prompt: list[int], kv_params: dict[str, Any] | None = None) -> Completion:
    return generate_together(llm, [prompt], kv_params)[0]


def generate_together(
    llm: Any, prompts: list[list[int]], kv_params: dict[str, Any] | None = None
) -> list[Completion]:
    """The prompts submitted at once (they wait in vLLM's queue together), in their order."""
    from vllm.inputs import TokensPrompt

    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts],
        sampling(kv_params),
        use_tqdm=False,
    )
    return [completion_of(output) for output in outputs]


# One engine step as the scheduler made it: (prompt index, tokens scheduled) for each request
# that ran. Steps that ran no request (waiting on a load) are left out.
Step = tuple[tuple[int, int], ...]


@contextlib.contextmanager
def recording_schedule(llm: Any) -> Iterator[list[dict[str, int]]]:
    """Every step's ``num_scheduled_tokens`` (request id -> tokens) of an in-process engine
    core, while the block runs."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    steps: list[dict[str, int]] = []
    schedule = scheduler.schedule

    def recorded(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        steps.append(dict(output.num_scheduled_tokens))
        return output

    scheduler.schedule = recorded
    try:
        yield steps
    finally:
        del scheduler.schedule  # the instance attribute: the class's method shows again


def schedule_of(steps: list[dict[str, int]], request_ids: list[str]) -> list[Step]:
    """The steps that ran work, with vLLM's request ids replaced by the prompts' indexes
    (the engine may add a suffix to the id it was given)."""

    return [
        tuple(sorted((_index(rid, request_ids), n) for rid, n in step.items()))
        for step in steps
        if step
    ]


def generate_together_scheduled(
    llm: Any, prompts: list[list[int]], kv_params: dict[str, Any] | None = None
) -> tuple[list[Completion], list[Step]]:
    """:func:`generate_together`, and the schedule the engine ran it in."""
    return generate_on_schedule(llm, prompts, [0] * len(prompts), kv_params)


def generate_on_schedule(
    llm: Any,
    prompts: list[list[int]],
    arrivals: list[int],
    kv_params: dict[str, Any] | None = None,
) -> tuple[list[Completion], list[Step]]:
    """Each prompt submitted just before the engine's ``arrivals[i]``-th step that runs work
    (0: before any), so a reference can be computed in the batches another run had: CPU
    kernels are not batch-invariant, so only the same batches give the same bits."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    ids = [f"sched-{i}" for i in range(len(prompts))]
    waiting = dict(enumerate(prompts))
    done: dict[int, Completion] = {}
    with recording_schedule(llm) as steps:
        while len(done) < len(prompts):
            ran = sum(1 for step in steps if step)
            for i in [i for i in waiting if arrivals[i] <= ran]:
                prompt = TokensPrompt(prompt_token_ids=waiting.pop(i))
                engine.add_request(ids[i], prompt, sampling(kv_params))
            for output in engine.step():
                if output.finished:
                    done[_index(output.request_id, ids)] = completion_of(output)
    return [done[i] for i in range(len(prompts))], schedule_of(steps, ids)


def _index(engine_id: str, request_ids: list[str]) -> int:
    return next(i for i, rid in enumerate(request_ids) if engine_id.startswith(rid))


def arrivals_of(schedule: list[Step], count: int) -> list[int]:
    """For each prompt, the index of the first step of ``schedule`` that ran it."""
    return [
        next(n for n, step in enumerate(schedule) if any(i == prompt for i, _ in step))
        for prompt in range(count)
    ]


def assert_same_completion(got: Completion, reference: Completion) -> None:
    """Same tokens and bit-identical logprobs: a restore that swaps two blocks can leave the
    greedy tokens unchanged, never the logprobs."""
    assert got.token_ids == reference.token_ids, "restored prefix changed the output tokens"
    assert got.logprobs == reference.logprobs, "restored prefix changed the logprobs"


def worker_counters(worker: Any) -> dict[str, int]:
    """Runs inside a vLLM worker (``collective_rpc`` passes it): the connector's counters."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return dict(get_kv_transfer_group().worker_side.counters)


def shutdown(llm: Any) -> None:
    """Stop an engine now (its connectors release their stores) and free what vLLM keeps per
    process, so a later engine in this process starts clean."""
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    llm.llm_engine.engine_core.shutdown()
    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


def store_paths(worker: Any) -> dict[str, dict[str, float]]:
    """Runs inside a vLLM worker: what each data path of its Ray client moved."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_side.store.stats(nodes=False)["paths"]


class EngineActor:
    """A vLLM offline engine inside a Ray actor: pinned to a node, it runs vLLM's default
    multi-process layout (engine core and worker in processes of their own)."""

    def __init__(self, args: dict[str, Any]) -> None:
        from vllm import LLM

        self.llm = LLM(**args)

    def generate(self, prompt: list[int], kv_params: dict[str, Any] | None = None) -> Completion:
        return generate(self.llm, prompt, kv_params)

    def counters(self) -> dict[str, int]:
        return self.llm.collective_rpc(worker_counters)[0]

    def paths(self) -> dict[str, dict[str, float]]:
        return self.llm.collective_rpc(store_paths)[0]

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
