"""Runs SGLang's real Engine on the tiny model in a process of its own (the CPU shims stay out
of the test process) and prints one JSON line with what it saw. Run by test_sglang_hicache.py:

    python tests/e2e/sglang_run.py MODEL_DIR STORE_ROOT

Two engines, one after the other: with HiCache and FlatCake as its L3 backend (request 1 =
the prefix, ``flush_cache()`` once it is backed up, request 2 = prefix + new tokens), then
without HiCache (request 2 alone, the reference).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.e2e import sglang_shims  # noqa: E402

sglang_shims.install()

from flatcake_ray.integrations.sglang import extra_config  # noqa: E402
from tests.e2e.tiny_model import words  # noqa: E402

PAGE = 32
PREFIX_TOKENS = 10 * PAGE
PREFIX = words(PREFIX_TOKENS, 123)
PROMPT = PREFIX + words(20, 4321)
SAMPLING = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def engine_kwargs(model: str) -> dict:
    """The CPU settings SGLang 0.5.23 needs for the tiny model (no CUDA kernels anywhere)."""
    return {
        "model_path": model,
        "device": "cpu",
        "attention_backend": "torch_native",
        "sampling_backend": "pytorch",
        "grammar_backend": "none",
        "disable_cuda_graph": True,
        "disable_overlap_schedule": True,
        "skip_tokenizer_init": True,
        "random_seed": 0,
        "mem_fraction_static": 0.05,
        "max_total_tokens": 8192,
        "page_size": PAGE,
        "context_length": 2048,
        "log_level": "warning",
    }


def hicache_kwargs(store_root: str) -> dict:
    backend = extra_config(
        store="local",
        store_root=store_root,
        store_dram_bytes="8MiB",
        store_ssd_file_bytes="16MiB",
        store_ssd_files_per_dir=2,
        store_ssd_min_run_bytes="256KiB",
        store_fsync=False,
    )
    return {
        "enable_hierarchical_cache": True,
        "hicache_mem_layout": "layer_first",
        "hicache_io_backend": "direct",
        "hicache_write_policy": "write_through",
        "hicache_size": 1,
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": json.dumps(backend),
    }


def flush(engine, timeout_s: float = 120.0) -> None:
    """flush_cache refuses while requests (or their backups) are pending: retry until done."""
    deadline = time.monotonic() + timeout_s
    while not engine.flush_cache().success:
        if time.monotonic() > deadline:
            raise TimeoutError("SGLang never flushed its cache")
        time.sleep(0.5)


def with_hicache(model: str, store_root: str) -> dict:
    import sglang

    engine = sglang.Engine(**engine_kwargs(model), **hicache_kwargs(store_root))
    try:
        engine.generate(input_ids=PREFIX, sampling_params=SAMPLING)
        # The write-through backup to the L3 and the prefetch probe run on threads of their
        # own; a flush while they are busy fails SGLang 0.5.23 ("Failed to stop HiCache
        # storage threads cleanly"), so let them go idle first.
        time.sleep(10.0)
        flush(engine)
        return engine.generate(input_ids=PROMPT, sampling_params=SAMPLING)
    finally:
        engine.shutdown()


def without_hicache(model: str) -> dict:
    import sglang

    engine = sglang.Engine(**engine_kwargs(model))
    try:
        return engine.generate(input_ids=PROMPT, sampling_params=SAMPLING)
    finally:
        engine.shutdown()


def main() -> None:
    model, store_root = sys.argv[1], sys.argv[2]
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    restored = with_hicache(model, store_root)
    reference = without_hicache(model)
    print(
        "RESULT "
        + json.dumps(
            {
                "prefix_tokens": PREFIX_TOKENS,
                "restored_ids": restored["output_ids"],
                "restored_details": restored["meta_info"].get("cached_tokens_details"),
                "restored_cached": restored["meta_info"].get("cached_tokens"),
                "reference_ids": reference["output_ids"],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
