"""``flatcake-ray replay``: the trace-replay model from the command line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flatcake_ray.cli.replay_live import add_live_arguments
from flatcake_ray.errors import ConfigError

HELP = """\
Replay a trace through a model of a serving engine (GPU HBM prefix cache, host DRAM, SSD,
H2D link, staging, prefill compute) that drives the live placement, allocation, coalescing
and FC-MAS code, and compare systems: recompute, dram-only, tiered (Mooncake-like),
tiered-gds, tiered-tuned, tiered-aware (eviction and admission by predicted reuse),
flatcake (Table 2 + DRAM read replicas), flatcake-table2, flatcake-admit, flatcake-fcfs,
oracle.

Hit rate = pages in HBM before prefill / pages an infinite cache would hold; TTFT = prefill
end - arrival. Writes result.json, results.md and PNG plots to --out, prints the table.

examples:
  flatcake-ray replay ../shared/traces/mooncake_conversation_trace.jsonl.gz \\
      --profile deepseek-v4-flash-b200 --qps 1,2,4 --seeds 0,1,2 --out bench_out/mooncake
  flatcake-ray replay --synth agentic --synth-scale 0.01 --qps 0.1,0.25,0.5,1 \\
      --profile deepseek-v4-flash-b200 --set hbm_kv_bytes=2GiB --set dram_bytes=16GiB
  flatcake-ray replay --synth agentic --sweep tau --values 256,1024,4096
  flatcake-ray replay --sweep context --values 8192,16384,32768,65536,131072
  flatcake-ray replay --list            (profiles and systems)
  flatcake-ray replay --measure         (this machine's memcpy and O_DIRECT numbers)
  flatcake-ray replay TRACE --live --limit 2000 --time-scale 0.25 --measure
                                        (against a local 2-node service, beside the model)
"""


def _floats(text: str) -> list[float | None]:
    return [None if part == "trace" else float(part) for part in text.split(",") if part]


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def add_replay_commands(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="compare FlatCake with tiered baselines on a trace (discrete-event model)",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("trace", nargs="?", help="trace file (Mooncake, Bailian, generic JSONL)")
    source = parser.add_argument_group("synthetic trace instead of a file")
    source.add_argument("--synth", choices=("agentic", "chat", "mixed"))
    source.add_argument("--synth-scale", type=float, default=0.01)
    source.add_argument("--synth-seed", type=int, default=0)
    model = parser.add_argument_group("model")
    model.add_argument("--systems", default="flatcake,tiered,dram-only")
    model.add_argument("--profile", default="this-machine")
    model.add_argument("--profile-json", help="JSON object of profile field overrides")
    model.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    model.add_argument("--capacity-scale", type=float, default=1.0, help="x DRAM and SSD")
    model.add_argument("--tau", type=int, help="placement tau_tokens")
    model.add_argument("--l-agent", type=int, help="placement l_agent_tokens")
    runs = parser.add_argument_group("runs")
    runs.add_argument("--qps", type=_floats, default=[None], help="e.g. 0.1,0.5,1 ('trace')")
    runs.add_argument("--seeds", type=_ints, default=[0])
    runs.add_argument(
        "--arrivals", default="jitter", choices=("jitter", "scaled", "poisson", "spread")
    )
    runs.add_argument("--sweep", default="qps", choices=("qps", "context", "tau", "l-agent"))
    runs.add_argument("--values", type=_ints, help="x values of a context/tau/l-agent sweep")
    runs.add_argument("--limit", type=int, help="replay only the first N requests")
    output = parser.add_argument_group("output")
    output.add_argument("--out", default="bench_out/replay", help="folder for JSON, table, plots")
    output.add_argument("--json", action="store_true", help="print the summary as JSON")
    output.add_argument("--no-progress", action="store_true")
    parser.add_argument("--list", action="store_true", help="list profiles and systems")
    parser.add_argument("--measure", action="store_true", help="measure this machine")
    add_live_arguments(parser)
    parser.set_defaults(handler=replay_command)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if args.profile_json:
        loaded = json.loads(Path(args.profile_json).read_text())
        if not isinstance(loaded, dict):
            raise ConfigError("--profile-json must hold a JSON object")
        found.update(loaded)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set wants FIELD=VALUE, got {item!r}")
        found[key.strip()] = value.strip()
    return found


def _trace(args: argparse.Namespace) -> Any:
    if args.synth:
        from flatcake_ray.traces.records import Trace
        from flatcake_ray.traces.synth import SyntheticTrace, SynthOptions

        options = SynthOptions(profile=args.synth, seed=args.synth_seed, scale=args.synth_scale)
        return Trace.from_requests(SyntheticTrace(options))
    if not args.trace:
        raise ConfigError("give a trace file or --synth PROFILE")
    return args.trace


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from flatcake_ray.replay import sweep

    systems = [s for s in args.systems.split(",") if s]
    common: dict[str, Any] = {
        "profile_overrides": _overrides(args),
        "progress": not args.no_progress,
    }
    if args.sweep == "context":
        values = args.values or [8192, 16384, 32768, 65536, 131072]
        profile = args.profile if args.profile != "this-machine" else "llama-3.1-70b-a100"
        return sweep.run_context_sweep(values, systems, profile, args.seeds, **common)
    trace = _trace(args)
    common.update(capacity_scale=args.capacity_scale, arrival_mode=args.arrivals)
    common["limit"] = args.limit
    if args.sweep in ("tau", "l-agent"):
        parameter = "tau_tokens" if args.sweep == "tau" else "l_agent_tokens"
        if not args.values:
            raise ConfigError(f"--sweep {args.sweep} needs --values")
        return sweep.run_placement_sweep(
            trace, parameter, args.values, systems, args.profile, args.qps[0], args.seeds, **common
        )
    return sweep.run_comparison(
        trace,
        systems,
        args.profile,
        args.qps,
        args.seeds,
        tau_tokens=args.tau,
        l_agent_tokens=args.l_agent,
        **common,
    )


def replay_command(args: argparse.Namespace) -> int:
    from flatcake_ray.replay import PROFILES, SYSTEMS, markdown_table, write_outputs
    from flatcake_ray.replay.profiles import measure_this_machine

    if args.live:
        from flatcake_ray.cli.replay_live import live_command

        return live_command(args, _trace(args))
    if args.list:
        for name, profile in PROFILES.items():
            print(f"profile {name}: {profile.source}")
        for name in SYSTEMS:
            print(f"system  {name}")
        return 0
    if args.measure:
        print(json.dumps(measure_this_machine(), indent=1))
        return 0
    result = _run(args)  # a ConfigError is one line from main()
    paths = write_outputs(result, args.out)
    if args.json:
        print(json.dumps(result["summary"], indent=1))
    else:
        print(markdown_table(result), end="")
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0
