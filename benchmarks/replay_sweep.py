"""Replay-model sweeps: the paper's Figure 6 (load), Figure 10 (context length), and the
tau / L_agent sensitivity the paper leaves open.

Run: ``.venv/bin/python benchmarks/replay_sweep.py [--quick] [--md docs/bench_replay.md]
[--out bench_out/replay]``

Sections (all on the DeepSeek-V4-Flash / B200 profile unless said otherwise):

1. ``agentic-tight``: a scaled-down synthetic Claude-Code-like trace (``trace synth
   --profile agentic --scale 0.01``: 4 sessions, 1,029 requests of ~200K tokens) against a
   prefix cache of ~1 context (2 GiB/rank HBM) and host DRAM *below* its working set
   (2 GiB/rank), SSD above its footprint: the paper's regime.
2. ``agentic-roomy``: the same trace with DRAM *above* its working set (8 GiB/rank).
3. ``mooncake``: the shared Mooncake conversation trace (12,031 requests) with the profile's
   full capacities (1 TiB DRAM, 4 TiB SSD).
4. ``tau`` (on the Mooncake trace: short-reply chat turns) and ``l_agent`` (on the synthetic
   mixed trace: sessions that turn agentic): FlatCake's placement thresholds.
5. ``context``: Figure 10 on the Llama-3.1-70B / A100 TP4 profile.

JSON, tables and PNGs of each section go to ``--out``; the markdown summary to ``--md``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatcake_ray.replay import (
    markdown_table,
    run_comparison,
    run_context_sweep,
    run_placement_sweep,
    write_outputs,
)
from flatcake_ray.traces.records import Trace
from flatcake_ray.traces.synth import SyntheticTrace, SynthOptions

MOONCAKE = (
    Path(__file__).resolve().parents[2] / "shared/traces/mooncake_conversation_trace.jsonl.gz"
)
PROFILE = "deepseek-v4-flash-b200"
ALL_SYSTEMS = (
    "flatcake",
    "flatcake-fcfs",
    "oracle",
    "tiered",
    "tiered-tuned",
    "tiered-gds",
    "dram-only",
)
NOTES = """
What the model is. One prefill engine (a TP group; one rank is simulated, all ranks being
symmetric) on a virtual clock: a GPU HBM prefix cache (LRU of pages, prefixes pinned while
in use), host DRAM, SSD workers (FIFO servers: a command costs `ssd_command_us` plus its
bytes at the worker's rate, capped by the drives' sum), an H2D link, host staging (tiered
systems) or a bounded number of GPU restore windows (FlatCake), and a serial prefill whose
time is `overhead + uncached/prefill_tokens_per_s + uncached*(cached + uncached/2)/
attention_pairs_per_s`. FlatCake runs the live `Catalog` (placement, extents, reclamation),
the live reader's extent descriptors + `coalesce` (per layer, reads capped at a staging slot,
as `restore_plan.py` issues them) and the live FC-MAS `Scheduler`; the tiered systems use the
same scheduler (unbounded prefetch budget), the same `coalesce` and one shared LRU + FIFO
bucket tier. Requests look storage up at arrival and again at dispatch (a request whose
prefix grew meanwhile on SSD goes back once for a prefetch; a revoked one is recomputed).

Assumed, not measured: compute rates, HBM budget, staging sizes, command costs (see
`flatcake_ray/replay/profiles.py`); the synthetic agentic trace keeps ~2 sessions active, so
HBM and DRAM budgets are set per section to put the working set where the section says.
Not modelled: decode (TTFT = prefill end - arrival; P/D disaggregation assumed), batching of
several prefills, HBM space taken by prefetched pages before their prefill, write-back
contention inside DRAM, multi-node placement, NVMe queue-depth effects beyond the per-command
cost. Known limits: a tiered SSD read is assumed to succeed even if its bucket is recycled
while it is in flight; a resubmitted restore re-reads what it had already read (counted as
read amplification); write amplification counts physical bytes (FlatCake's 4 KiB layer
alignment included).
"""
TIGHT = {"hbm_kv_bytes": "2GiB", "dram_bytes": "16GiB", "ssd_bytes": "512GiB"}
ROOMY = {"hbm_kv_bytes": "2GiB", "dram_bytes": "64GiB", "ssd_bytes": "512GiB"}


def synthetic(profile: str, scale: float) -> Trace:
    return Trace.from_requests(SyntheticTrace(SynthOptions(profile=profile, seed=0, scale=scale)))


def sections(quick: bool) -> list[tuple[str, str, Any]]:
    seeds = (0,) if quick else (0, 1, 2)
    qps = (0.1, 0.5, 1.0) if quick else (0.1, 0.25, 0.5, 0.75, 1.0)
    agentic = synthetic("agentic", 0.01)
    mixed = synthetic("mixed", 0.01)
    return [
        (
            "agentic-tight",
            "Synthetic agentic trace, DRAM below the working set (Figure 6 shape)",
            lambda: run_comparison(
                agentic, ALL_SYSTEMS, PROFILE, qps, seeds, profile_overrides=TIGHT
            ),
        ),
        (
            "agentic-roomy",
            "Synthetic agentic trace, DRAM above the working set",
            lambda: run_comparison(
                agentic,
                ("flatcake", "tiered", "tiered-gds", "dram-only"),
                PROFILE,
                (0.1, 0.5, 1.0),
                (0,),
                profile_overrides=ROOMY,
            ),
        ),
        (
            "mooncake",
            "Mooncake conversation trace, full profile capacities",
            lambda: run_comparison(
                MOONCAKE,
                ("flatcake", "oracle", "tiered", "tiered-gds", "dram-only"),
                PROFILE,
                (1.0, 2.0, 3.0) if not quick else (2.0,),
                (0, 1) if not quick else (0,),
            ),
        ),
        (
            "tau",
            "FlatCake's tau (short-reply threshold), Mooncake trace, 2 QPS",
            lambda: run_placement_sweep(
                MOONCAKE,
                "tau_tokens",
                (128, 512, 2048, 8192),
                ("flatcake",),
                PROFILE,
                2.0,
                (0,),
            ),
        ),
        (
            "l_agent",
            "FlatCake's L_agent (agentic context threshold), synthetic mixed trace, 0.5 QPS",
            lambda: run_placement_sweep(
                mixed,
                "l_agent_tokens",
                (8192, 32768, 131072, 524288),
                ("flatcake",),
                PROFILE,
                0.5,
                seeds,
                profile_overrides=TIGHT,
            ),
        ),
        (
            "context",
            "Context length (Figure 10), Llama-3.1-70B on A100 TP4",
            lambda: run_context_sweep(
                (8192, 16384, 32768, 65536, 131072),
                ("recompute", "dram-only", "tiered", "tiered-gds", "flatcake"),
                "llama-3.1-70b-a100",
                (0,),
            ),
        ),
    ]


def capacity_text(profile: dict[str, Any]) -> str:
    ranks = profile.get("ranks", 1)
    per_rank = {
        "HBM": profile.get("hbm_kv_bytes", 0),
        "DRAM": profile.get("dram_bytes", 0) / ranks,
        "SSD": profile.get("ssd_bytes", 0) / ranks,
    }
    return ", ".join(f"{name} {value / 2**30:g} GiB" for name, value in per_rank.items()) + (
        " per rank"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, fewer loads")
    parser.add_argument("--md", default="docs/bench_replay.md")
    parser.add_argument("--out", default="bench_out/replay")
    parser.add_argument("--only", help="comma-separated section names")
    args = parser.parse_args()
    wanted = set(args.only.split(",")) if args.only else None
    command = "python benchmarks/replay_sweep.py" + (" --quick" if args.quick else "")
    parts = [
        "# Replay model: FlatCake vs tiered baselines\n",
        f"Command: `{command}` ({platform.node()}, {platform.processor() or 'cpu'}, "
        f"{time.strftime('%Y-%m-%d')}). Model documentation: `flatcake_ray/replay/`. "
        "Hit rate = delivered / reusable pages; ± = sample std over seeds (arrival jitter).\n",
        NOTES,
    ]
    for name, title, run in sections(args.quick):
        if wanted and name not in wanted:
            continue
        start = time.perf_counter()
        result = run()
        seconds = time.perf_counter() - start
        paths = write_outputs(result, Path(args.out) / name)
        config = result["config"]
        parts.append(f"\n## {title}\n")
        profile = config.get("profile", {})
        capacities = capacity_text(profile)
        requests = config.get("requests", "per-length")
        ceiling = config.get("reuse_ceiling")
        parts.append(
            f"`{name}`: profile {profile.get('name')} ({capacities}); {requests} requests"
            + (f", reuse ceiling {100 * ceiling:.1f}% of pages" if ceiling is not None else "")
            + f"; {len(result['runs'])} runs in {seconds:.0f} s "
            f"({seconds / max(len(result['runs']), 1):.1f} s per run); JSON and plots in "
            f"`{Path(paths['json']).parent}/`.\n\n"
        )
        parts.append(markdown_table(result))
        print(f"{name}: {len(result['runs'])} runs, {seconds:.0f} s", flush=True)
    Path(args.md).parent.mkdir(parents=True, exist_ok=True)
    Path(args.md).write_text("".join(parts))
    print(f"wrote {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
