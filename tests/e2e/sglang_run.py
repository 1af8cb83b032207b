"""Runs SGLang's real Engine on the tiny model in a process of its own (the CPU shims stay out
of the test process) and prints one JSON line with what it saw. Run by test_sglang_hicache.py:

    python tests/e2e/sglang_run.py hicache MODEL_DIR STORE_ROOT NCCL_PORT
    python tests/e2e/sglang_run.py reference MODEL_DIR NCCL_PORT

``hicache``: an engine with HiCache and FlatCake as its L3 backend (request 1 = the prefix,
``flush_cache()`` once it is backed up, request 2 = prefix + new tokens). ``reference``: an
engine without HiCache (request 2 alone). The test runs the two at once, one process each
(each engine is a process tree of its own; most of its cost is starting it).
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


def engine_kwargs(model: str, nccl_port: int) -> dict:
    """The CPU settings SGLang 0.5.23 needs for the tiny model (no CUDA kernels anywhere);
    ``nccl_port`` (its torch.distributed rendezvous) is chosen by the test, so two engines
    started at once never race for the same free port."""
    return {
        "model_path": model,
        "nccl_port": nccl_port,
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
        "hicache_ratio": 2.0,  # host pool = 2x the device pool: about 12 MB for the tiny model
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": json.dumps(backend),
    }


def flush(engine, timeout_s: float = 120.0) -> None:
    """flush_cache refuses until the scheduler is fully idle, which for HiCache includes no
    write-through, backup to the L3 or prefetch in flight (``Scheduler.is_fully_idle``), so
    retrying it until it succeeds is the wait for the prefix to reach FlatCake."""
    deadline = time.monotonic() + timeout_s
    while not engine.flush_cache().success:
        if time.monotonic() > deadline:
            raise TimeoutError("SGLang never flushed its cache")
        time.sleep(0.5)


def with_hicache(model: str, store_root: str, nccl_port: int) -> dict:
    import sglang

    build_native_hash()
    engine = sglang.Engine(**engine_kwargs(model, nccl_port), **hicache_kwargs(store_root))
    try:
        engine.generate(input_ids=PREFIX, sampling_params=SAMPLING)
        flush(engine)  # waits for the write-through backup of the prefix to the L3
        return engine.generate(input_ids=PROMPT, sampling_params=SAMPLING)
    finally:
        engine.shutdown()


def without_hicache(model: str, nccl_port: int) -> dict:
    import sglang

    engine = sglang.Engine(**engine_kwargs(model, nccl_port))
    try:
        return engine.generate(input_ids=PROMPT, sampling_params=SAMPLING)
    finally:
        engine.shutdown()


def build_native_hash() -> None:
    """SGLang hashes HiCache pages with a C++ extension it JIT-builds (torch cpp_extension,
    ninja) on first use, on the prefetch thread of the first request. That build takes
    minutes on a loaded 2-core machine, and a flush meanwhile fails SGLang 0.5.23 ("Failed to
    stop HiCache storage threads cleanly": it joins that thread for 10 s). Build (or load the
    cached build, under TORCH_EXTENSIONS_DIR) here, before any engine starts."""
    from sglang.srt.mem_cache.cpp_utils import native_hash

    if not hasattr(native_hash, "_load_native_hash_module"):
        raise sglang_shims.ShimError("sglang's native_hash._load_native_hash_module moved")
    native_hash._load_native_hash_module()


def main() -> None:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    mode, model, *rest = sys.argv[1:]
    if mode == "hicache":
        store_root, port = rest
        restored = with_hicache(model, store_root, int(port))
        result = {
            "prefix_tokens": PREFIX_TOKENS,
            "restored_ids": restored["output_ids"],
            "restored_details": restored["meta_info"].get("cached_tokens_details"),
            "restored_cached": restored["meta_info"].get("cached_tokens"),
        }
    elif mode == "reference":
        (port,) = rest
        result = {"reference_ids": without_hicache(model, int(port))["output_ids"]}
    else:
        raise SystemExit(f"unknown mode {mode!r}: hicache or reference")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
