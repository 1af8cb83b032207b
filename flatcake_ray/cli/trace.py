"""``flatcake-ray trace stats`` and ``flatcake-ray trace synth``.

:func:`add_trace_commands` registers ``trace`` with its two subcommands on the main
parser's subparsers; each sets ``handler`` to a function ``(args) -> int`` (exit status).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from flatcake_ray.cli import print_error
from flatcake_ray.errors import ConfigError, TraceFormatError
from flatcake_ray.traces.infer import DEFAULT_COMMON_FANOUT
from flatcake_ray.traces.readers import iter_requests, write_generic
from flatcake_ray.traces.records import TraceRequest
from flatcake_ray.traces.stats import TraceStatsAccumulator, compute_stats, format_stats
from flatcake_ray.traces.synth import ARRIVAL_MODES, SyntheticTrace, SynthOptions
from flatcake_ray.traces.synth_profiles import PROFILES

STATS_DESCRIPTION = """\
Print the paper's Table 1 row (KV reuse under an infinite-capacity cache) of each trace.
Formats (Mooncake, Qwen Bailian, generic JSONL) and gzip are detected from the content.

Requests are numbered 0, 1, 2, ... in file (arrival) order; a request's blocks are its
distinct block ids.
  requests          number of requests
  unique_blocks     number of distinct block ids
  once_access_pct   100 * (blocks that occur in exactly one request) / unique_blocks
  reuse_distance_mean, reuse_distance_p99
                    over every re-access of a block: this request's number minus the
                    number of the last earlier request holding the block; mean and 99th
                    percentile (numpy linear). Reproduces the paper's Mooncake row (728,
                    5,527). It is the count of requests strictly in between plus one.
  reuse_distance_intervening_mean, reuse_distance_intervening_p99
                    the same minus one (the paper's Claude Code row, mean 0.85 < 1, can
                    only be this one)
  hit_rate_pct      100 * (accesses to a block an earlier request held) / all accesses
  sessions          distinct session ids, or inferred from prefix chains when a request
                    has none (a request continues the session of the last request holding
                    its deepest shared block, unless that block is followed by at least
                    --common-fanout distinct blocks, like a shared system prompt)
  mean_blocks_per_request, span_seconds (last - first arrival), mean_qps (requests/span)

--block-tokens N re-blocks to N-token blocks, N a whole multiple of the native size:
each run of N/native consecutive blocks of a request (and its shorter tail) becomes one
block named by its last native block's id (ids are prefix-chained, so that id stands for
the whole prefix). Sessions are still inferred on the native blocks.
"""

SYNTH_DESCRIPTION = """\
Write a synthetic trace in the generic JSONL format (gzip when --out ends in .gz):
{"t", "session", "turn", "block_tokens", "input_tokens", "output_tokens", "blocks"}.

Profiles (full size at --scale 1):
  agentic  Claude-Code-like: 393 sessions, ~99K requests, 64-token blocks, ~3.4K blocks
           per request, sub-agents replaying the session prefix. About 340M block ids
           (several GB of JSON) at full size, so the default scale is 0.01.
  chat     Mooncake-conversation-like: 7,373 sessions, ~12K requests, 512-token blocks,
           ~75% once-access, reuse distances of hundreds of requests. Default scale 1.
           (Its reuse distances shrink with the scale: a smaller trace spans less time.)
  mixed    both on one clock, 64-token blocks, plus sessions that turn from chat to
           agentic after 2-4 turns. Default scale 0.1.
Arrivals are a Poisson process at --qps in the model's arrival order. Deterministic for a
given --seed. --stats prints the trace's Table 1 row, measured as it is generated (with
no --out, nothing is written: the way to measure a full-size agentic trace).
"""

DEFAULT_SCALES = {"agentic": 0.01, "chat": 1.0, "mixed": 0.1}
_LARGE_OUTPUT_IDS = 50_000_000


def add_trace_commands(subparsers: Any) -> None:
    """Register ``trace stats`` and ``trace synth`` on ``subparsers``."""
    trace = subparsers.add_parser("trace", help="KV-cache trace statistics and synthesis")
    commands = trace.add_subparsers(dest="trace_command", required=True)
    _add_stats(commands)
    _add_synth(commands)


def _add_stats(commands: Any) -> None:
    stats = commands.add_parser(
        "stats",
        help="Table 1 reuse statistics of trace files",
        description=STATS_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    stats.add_argument("paths", nargs="+", metavar="PATH", help="trace file(s), gzip or not")
    stats.add_argument(
        "--block-tokens",
        type=int,
        default=None,
        metavar="N",
        help="re-block to N-token blocks, a multiple of the native size (default: native)",
    )
    stats.add_argument("--json", action="store_true", help="one JSON object per trace")
    stats.add_argument(
        "--common-fanout",
        type=int,
        default=DEFAULT_COMMON_FANOUT,
        metavar="N",
        help="session inference: successor count that marks a shared block (default %(default)s)",
    )
    stats.set_defaults(handler=run_stats)


def _add_synth(commands: Any) -> None:
    synth = commands.add_parser(
        "synth",
        help="write a synthetic agentic, chat or mixed trace",
        description=SYNTH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    synth.add_argument("--profile", choices=sorted(PROFILES), required=True)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--out", default=None, metavar="PATH", help="output file (.gz: gzip)")
    synth.add_argument(
        "--scale",
        type=float,
        default=None,
        metavar="F",
        help="fraction of the full session count (default: agentic 0.01, chat 1, mixed 0.1)",
    )
    synth.add_argument("--qps", type=float, default=None, help="mean arrival rate")
    synth.add_argument(
        "--context-scale",
        type=float,
        default=1.0,
        metavar="F",
        help="multiply every token length (prompts, outputs, tool outputs) by F",
    )
    synth.add_argument(
        "--block-tokens", type=int, default=None, metavar="N", help="default: the profile's"
    )
    synth.add_argument("--arrivals", choices=ARRIVAL_MODES, default="poisson")
    synth.add_argument("--stats", action="store_true", help="print the Table 1 row too")
    synth.add_argument("--json", action="store_true", help="with --stats: as JSON")
    synth.set_defaults(handler=run_synth)


def run_stats(args: argparse.Namespace) -> int:
    status = 0
    for path in args.paths:
        try:
            stats = compute_stats(
                iter_requests(path),
                block_tokens=args.block_tokens,
                common_fanout=args.common_fanout,
            )
        except (OSError, TraceFormatError, ConfigError) as exc:
            print_error(f"trace stats: {path}: {exc}")
            status = 1
            continue
        _print_stats(stats, path, as_json=args.json)
    return status


def run_synth(args: argparse.Namespace) -> int:
    if args.out is None and not args.stats:
        print_error("trace synth: give --out PATH, --stats, or both")
        return 2
    scale = DEFAULT_SCALES[args.profile] if args.scale is None else args.scale
    options = SynthOptions(
        profile=args.profile,
        seed=args.seed,
        scale=scale,
        qps=args.qps,
        block_tokens=args.block_tokens,
        arrivals=args.arrivals,
        context_scale=args.context_scale,
    )
    trace = SyntheticTrace(options)  # a ConfigError is one line from main()
    if args.out is not None and trace.total_block_ids > _LARGE_OUTPUT_IDS:
        print(
            f"trace synth: writing {len(trace):,} requests with {trace.total_block_ids:,} "
            f"block ids to {args.out}; this takes a while",
            file=sys.stderr,
        )
    started = time.monotonic()
    accumulator = TraceStatsAccumulator() if args.stats else None
    requests = _measured(iter(trace), accumulator)
    if args.out is not None:
        count = write_generic(args.out, requests)
        elapsed = time.monotonic() - started
        print(f"wrote {count:,} requests to {args.out} in {elapsed:.1f} s", file=sys.stderr)
    else:
        for _ in requests:
            pass
    if accumulator is not None:
        _print_stats(accumulator.result(), f"synth {args.profile} x{scale}", as_json=args.json)
    return 0


def _measured(
    requests: Iterator[TraceRequest], accumulator: TraceStatsAccumulator | None
) -> Iterator[TraceRequest]:
    for request in requests:
        if accumulator is not None:
            accumulator.add(request)
        yield request


def _print_stats(stats: Any, label: str, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"path": label, **stats.to_dict()}))
    else:
        print(format_stats(stats, label))
