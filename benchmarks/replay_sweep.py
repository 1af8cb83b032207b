"""Replay-model sweep for issue 14: every system on every (trace, profile, capacity, load)
cell, the goal checked cell by cell, and the paper's open questions.

Run: ``.venv/bin/python benchmarks/replay_sweep.py [--quick] [--jobs 2] [--only a,b]
[--md docs/bench_replay.md] [--out bench_out/replay] [--figures docs/figures/replay]``

Cells (DeepSeek-V4-Flash on 8 B200s unless said otherwise; 3 seeds of arrival jitter each):

- ``agentic-tight`` / ``agentic-roomy``: the synthetic Claude-Code-like trace (4 sessions,
  1,029 requests of ~200K tokens) with host DRAM below (2 GiB/rank) and above (8 GiB/rank)
  its working set; HBM holds about one context (2 GiB/rank).
- ``commodity-2drive`` / ``commodity-1drive``: agentic-tight on a machine with 2 (1) NVMe
  drives instead of 8: the same GPUs and DRAM, 1/4 (1/8) of the SSD bandwidth.
- ``mooncake``: the shared Mooncake conversation trace (low reuse, chat/API shape).
- ``chat``: the synthetic chat profile (Mooncake-like sessions, 1,196 requests).
- ``mixed``: agentic, chat and chat-turning-agentic sessions on one clock (682 requests);
  also reported per session class.
- ``context``: Figure 10 (Llama-3.1-70B on A100 TP4), per context length.
- ``tau-*`` / ``l_agent-*``: placement thresholds at a low and a high load.
- ``alternatives-*``: the DRAM policies that were tried (placement.py), side by side.

Scaled for 2 shared cores: the synthetic agentic and mixed traces are replayed with 1,024-
token pages (4x fewer pages than the engine's 256; every system alike), Mooncake with
512-token pages (its block size; whole trace), context lengths 8K/32K/128K, two or three
loads per cell. ``--quick``: one seed, fewer loads, Mooncake's first 3,000 requests (a
smoke run).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from functools import partial
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
from flatcake_ray.replay.goal import goal_rows, goal_table
from flatcake_ray.replay.report import CLASS_COLUMNS, merge_results
from flatcake_ray.traces.records import Trace
from flatcake_ray.traces.synth import SyntheticTrace, SynthOptions

REPO = Path(__file__).resolve().parents[1]
TRACE_NAME = "shared/traces/mooncake_conversation_trace.jsonl.gz"
# Beside the checkout (/work/main -> /work/shared) or beside a worktree's parent folder.
MOONCAKE = next(
    (path for path in (REPO.parent / TRACE_NAME, REPO.parents[1] / TRACE_NAME) if path.exists()),
    REPO.parent / TRACE_NAME,
)
PROFILE = "deepseek-v4-flash-b200"
GOAL_SYSTEMS = (
    "flatcake",
    "flatcake-table2",
    "oracle",
    "tiered",
    "tiered-tuned",
    "tiered-aware",
    "tiered-gds",
    "dram-only",
)
ALTERNATIVES = ("flatcake-admit", "flatcake-fcfs")
ALTERNATIVE_BASES = {  # the goal cell whose runs of the other systems an alternatives table reuses
    "alternatives-tight": "agentic-tight",
    "alternatives-roomy": "agentic-roomy",
    "alternatives-mooncake": "mooncake",
}
FLAT_PAIR = ("flatcake", "flatcake-table2")
PAGES_1K = {"page_tokens": 1024}
TIGHT = {"hbm_kv_bytes": "2GiB", "dram_bytes": "16GiB", "ssd_bytes": "512GiB", **PAGES_1K}
ROOMY = {**TIGHT, "dram_bytes": "64GiB"}
CHAT = {"hbm_kv_bytes": "4GiB", "dram_bytes": "32GiB", "ssd_bytes": "512GiB", "page_tokens": 512}
MOONCAKE_SCALE = {"page_tokens": 512}
QUICK_MOONCAKE_REQUESTS = 3000


def synthetic(profile: str, scale: float) -> Trace:
    return Trace.from_requests(SyntheticTrace(SynthOptions(profile=profile, seed=0, scale=scale)))


def sections(quick: bool) -> list[tuple[str, str, str, Any]]:
    """(name, title, role, runner); role: goal | alternatives | sensitivity."""
    seeds = (0,) if quick else (0, 1, 2)
    agentic = partial(synthetic, "agentic", 0.01)
    mixed = partial(synthetic, "mixed", 0.01)
    chat = partial(synthetic, "chat", 0.1)

    def compare(trace, overrides, loads, systems=GOAL_SYSTEMS, **options):
        return lambda keep: run_comparison(
            trace() if callable(trace) else trace,
            tuple(filter(keep, systems)),
            PROFILE,
            loads,
            seeds,
            profile_overrides=overrides,
            progress=False,
            **options,
        )

    def placement(trace, parameter, values, load, overrides):
        return lambda keep: run_placement_sweep(
            trace(), parameter, values, tuple(filter(keep, FLAT_PAIR)), PROFILE, load, seeds,
            profile_overrides=overrides, progress=False,
        )  # fmt: skip

    pick = (lambda full, short: short) if quick else (lambda full, short: full)
    moon = {"limit": pick(None, QUICK_MOONCAKE_REQUESTS)}
    return [
        ("agentic-tight", "Agentic, DRAM below the working set (Figure 6 shape)", "goal",
         compare(agentic, TIGHT, pick((0.1, 0.5, 0.75, 1.0), (0.25, 1.0)))),
        ("agentic-roomy", "Agentic, DRAM above the working set", "goal",
         compare(agentic, ROOMY, pick((0.1, 0.5, 1.0), (1.0,)))),
        ("commodity-2drive", "Agentic, DRAM below the working set, 2 NVMe drives", "goal",
         compare(agentic, {**TIGHT, "ssd_drives": 2}, pick((0.5, 1.0), (0.5,)))),
        ("commodity-1drive", "Agentic, DRAM below the working set, 1 NVMe drive", "goal",
         compare(agentic, {**TIGHT, "ssd_drives": 1}, pick((0.5,), (0.5,)))),
        ("mooncake", "Mooncake conversation trace, full profile capacities", "goal",
         compare(MOONCAKE, MOONCAKE_SCALE, pick((1.0, 2.0), (2.0,)), **moon)),
        ("chat", "Synthetic chat profile (low reuse)", "goal",
         compare(chat, CHAT, pick((1.0, 2.0, 4.0), (2.0,)))),
        ("mixed", "Mixed: agentic, chat, and chat turning agentic", "goal",
         compare(mixed, TIGHT, pick((0.25, 1.0), (0.5,)))),
        ("context", "Context length (Figure 10), Llama-3.1-70B on A100 TP4", "goal",
         lambda keep: run_context_sweep(
             pick((8192, 32768, 131072), (32768,)),
             tuple(filter(keep, ("recompute", *GOAL_SYSTEMS))),
             "llama-3.1-70b-a100", seeds, progress=False)),
        ("alternatives-tight", "DRAM policies tried, agentic-tight", "alternatives",
         compare(agentic, TIGHT, pick((0.5, 1.0), (1.0,)), ALTERNATIVES)),
        ("alternatives-roomy", "DRAM policies tried, agentic-roomy", "alternatives",
         compare(agentic, ROOMY, pick((0.5, 1.0), (1.0,)), ALTERNATIVES)),
        ("alternatives-mooncake", "DRAM policies tried, Mooncake", "alternatives",
         compare(MOONCAKE, MOONCAKE_SCALE, (2.0,), ALTERNATIVES, **moon)),
        ("tau-low", "tau (short-reply threshold), synthetic chat, 1 QPS", "sensitivity",
         placement(chat, "tau_tokens", (128, 512, 2048, 8192), 1.0, CHAT)),
        ("tau-high", "tau (short-reply threshold), synthetic chat, 4 QPS", "sensitivity",
         placement(chat, "tau_tokens", (128, 512, 2048, 8192), 4.0, CHAT)),
        ("l_agent-low", "L_agent (agentic context threshold), mixed, 0.25 QPS", "sensitivity",
         placement(mixed, "l_agent_tokens", (8192, 32768, 131072, 524288), 0.25, TIGHT)),
        ("l_agent-high", "L_agent (agentic context threshold), mixed, 1 QPS", "sensitivity",
         placement(mixed, "l_agent_tokens", (8192, 32768, 131072, 524288), 1.0, TIGHT)),
    ]  # fmt: skip


def run_section(
    name: str, quick: bool, only: tuple[str, ...] | None = None
) -> tuple[str, dict[str, Any], float]:
    """Run a section; ``only``: just these of its systems."""
    runner = next(run for n, _, _, run in sections(quick) if n == name)
    start = time.perf_counter()
    result = runner(lambda system: only is None or system in only)
    return name, result, time.perf_counter() - start


def with_saved(result: dict[str, Any], saved: dict[str, Any], rerun: tuple[str, ...]):
    """A section rerun for ``rerun`` systems, completed by the saved runs of the others."""
    runs = [r for r in saved["runs"] if r["system"] not in rerun] + result["runs"]
    summary = [r for r in saved["summary"] if r["system"] not in rerun] + result["summary"]
    return {**saved, "runs": runs, "summary": summary}


def capacity_text(profile: dict[str, Any]) -> str:
    ranks = profile.get("ranks", 1)
    sizes = {
        "HBM": profile.get("hbm_kv_bytes", 0),
        "DRAM": profile.get("dram_bytes", 0) / ranks,
        "SSD": profile.get("ssd_bytes", 0) / ranks,
    }
    text = ", ".join(f"{name} {value / 2**30:g} GiB" for name, value in sizes.items())
    drives, page = profile.get("ssd_drives"), profile.get("page_tokens")
    return f"{text} per rank, {drives} drives, {page}-token pages"


def section_text(name: str, title: str, result: dict[str, Any], seconds: float, figure: str) -> str:
    config = result["config"]
    profile = config.get("profile", {})
    ceiling = config.get("reuse_ceiling")
    runs = len(result["runs"])
    lines = [
        f"\n### {title}\n",
        f"`{name}`: profile {profile.get('name')} ({capacity_text(profile)}); "
        f"{config.get('requests', 'per-length')} requests"
        + (f", reuse ceiling {100 * ceiling:.1f}% of pages" if ceiling is not None else "")
        + f"; {runs} runs in {seconds:.0f} s ({seconds / max(runs, 1):.1f} s per run).\n",
    ]
    if figure:
        lines.append(f"\n![{name}]({figure})\n")
    lines.append("\n" + markdown_table(result))
    if name == "mixed":
        lines.append("\nBy session class (sessions that change class are `switch`):\n\n")
        lines.append(markdown_table(result, CLASS_COLUMNS))
    return "".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, fewer loads")
    parser.add_argument("--jobs", type=int, default=2, help="sections run in parallel")
    parser.add_argument("--md", default="docs/bench_replay.md")
    parser.add_argument("--out", default="bench_out/replay")
    parser.add_argument("--figures", default="docs/figures/replay", help="'' to skip")
    parser.add_argument("--only", help="comma-separated section names")
    parser.add_argument(
        "--reuse", action="store_true", help="load sections whose result.json is in --out"
    )
    parser.add_argument(
        "--rerun",
        help="comma-separated systems: sections saved in --out rerun only these and keep the "
        "saved runs of the others (after a change that only they see)",
    )
    args = parser.parse_args()
    chosen = [s for s in sections(args.quick) if not args.only or s[0] in args.only.split(",")]
    wants_mooncake = any(name.endswith("mooncake") for name, *_ in chosen)
    if wants_mooncake and not MOONCAKE.exists():
        parser.error(f"the Mooncake trace is not at {MOONCAKE}")
    started = time.perf_counter()
    saved = load_saved(chosen, Path(args.out)) if args.reuse or args.rerun else {}
    rerun = tuple(args.rerun.split(",")) if args.rerun else None
    done = {} if rerun else saved
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        todo = [name for name, *_ in chosen if name not in done]
        todo.sort(key=lambda name: not name.endswith("mooncake"))  # the longest ones first
        futures = [
            pool.submit(run_section, name, args.quick, rerun if name in saved else None)
            for name in todo
        ]
        for future in as_completed(futures):
            try:
                name, result, seconds = future.result()
            except Exception as exc:  # one broken section must not cost the others' hours
                print(f"a section failed: {exc!r}", file=sys.stderr, flush=True)
                continue
            if rerun and name in saved:
                old, old_seconds = saved[name]
                result, seconds = with_saved(result, old, rerun), seconds + old_seconds
            done[name] = (result, seconds)
            result["config"]["section_seconds"] = seconds
            write_outputs(result, Path(args.out) / name)  # usable before the sweep ends
            print(f"{name}: {len(result['runs'])} runs, {seconds:.0f} s", flush=True)
    total = sum(seconds for _, seconds in done.values())
    chosen = [section for section in chosen if section[0] in done]
    md = Path(args.md)
    findings = kept_findings(md.read_text() if md.exists() else "")
    md.write_text(compose(chosen, done, args, total, findings))
    print(f"wrote {args.md} ({total:.0f} s of sections, {time.perf_counter() - started:.0f} s)")
    return 0


def load_saved(chosen, out: Path) -> dict[str, tuple[dict[str, Any], float]]:
    saved = {}
    for name, *_ in chosen:
        path = out / name / "result.json"
        if path.exists():
            result = json.loads(path.read_text())
            saved[name] = (result, result["config"].get("section_seconds", 0.0))
    return saved


FINDINGS = ("<!-- findings: written by hand, kept by reruns -->", "<!-- /findings -->")


def kept_findings(text: str) -> str:
    """The hand-written findings block of an earlier ``--md``, markers included."""
    start, end = (text.find(marker) for marker in FINDINGS)
    return text[start : end + len(FINDINGS[1])] + "\n" if 0 <= start < end else ""


def compose(chosen, done, args, total: float, findings: str = "") -> str:
    command = "python " + shlex.join(["benchmarks/replay_sweep.py", *sys.argv[1:]])
    parts = [
        "# Replay model: FlatCake vs tiered baselines\n\n",
        f"Command: `{command}` ({platform.node()}, {time.strftime('%Y-%m-%d')}; "
        f"{len(chosen)} sections, {total / 60:.0f} min of section time, run {args.jobs} "
        "at a time on a shared 2-core VM). "
        "Hit rate = delivered / reusable pages; ± = sample std over seeds (arrival jitter). "
        "The model is described in `flatcake_ray/replay/`; the placement rule in "
        "`docs/placement.md`.\n",
    ]
    parts.append("\n" + findings if findings else "")
    goal = [row for name, _, role, _ in chosen if role == "goal" for row in
            goal_rows(name, done[name][0])]  # fmt: skip
    if goal:
        met = sum(row.met for row in goal)
        parts.append(f"\n## The goal, cell by cell ({met} of {len(goal)} cells met)\n\n")
        parts.append(goal_table(goal))
    for role, heading in (
        ("goal", "Cells"),
        ("alternatives", "Alternatives tried"),
        ("sensitivity", "Sensitivity"),
    ):
        parts.append(f"\n## {heading}\n")
        for name, title, section_role, _ in chosen:
            if section_role != role:
                continue
            result, seconds = done[name]
            if role == "alternatives" and ALTERNATIVE_BASES[name] in done:
                base = done[ALTERNATIVE_BASES[name]][0]
                result = merge_results(
                    result, base, ("flatcake", "flatcake-table2", "tiered-aware")
                )
            figure = publish_figure(result, name, args)
            parts.append(section_text(name, title, result, seconds, figure))
    return "".join(parts)


def publish_figure(result: dict[str, Any], name: str, args: argparse.Namespace) -> str:
    paths = write_outputs(result, Path(args.out) / name)  # again: merged tables differ
    if not args.figures:
        return ""
    target = Path(args.figures) / f"{name}.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(paths["overview"], target)
    return str(target.relative_to(Path(args.md).parent)) if target.is_relative_to(
        Path(args.md).parent) else str(target)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
