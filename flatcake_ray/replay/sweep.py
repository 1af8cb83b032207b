"""Runs and sweeps: one replay, a system comparison over loads, context lengths, tau, L_agent.

Every sweep returns the same shape of dict (JSON-ready), which :func:`write_outputs` turns
into ``result.json``, ``results.md`` and PNG plots::

    {"kind": "qps" | "context" | "tau_tokens" | "l_agent_tokens", "x_name": ..., "config": {...},
     "runs": [one summary per (system, x, seed)],
     "summary": [{"system", "x", "seeds", <metric>: {"mean", "std", "min", "max"}}]}
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from flatcake_ray.config import PlacementConfig
from flatcake_ray.errors import ConfigError
from flatcake_ray.replay.engine import Replay
from flatcake_ray.replay.metrics import aggregate, summarize
from flatcake_ray.replay.pages import TracePages, build_pages
from flatcake_ray.replay.profiles import Profile, get_profile
from flatcake_ray.replay.systems import SystemSpec, get_system
from flatcake_ray.replay.workloads import arrivals_for, as_trace, context_length_trace
from flatcake_ray.traces.records import Trace, TraceRequest

TraceSource = Trace | Iterable[TraceRequest] | str | Path
DEFAULT_SYSTEMS = ("flatcake", "tiered", "dram-only")


def run_one(
    pages: TracePages,
    profile: Profile,
    system: str | SystemSpec,
    *,
    qps: float | None,
    seed: int = 0,
    placement: PlacementConfig | None = None,
    arrival_mode: str = "jitter",
    on_request: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Replay ``pages`` once; returns the run's summary (see :mod:`.metrics`)."""
    spec = get_system(system)
    start = time.perf_counter()
    replay = Replay(pages, arrivals_for(pages, qps, seed, arrival_mode), profile, spec, placement)
    replay.run(on_request)
    summary = summarize(replay, time.perf_counter() - start)
    return {"system": spec.name, "qps": qps, "seed": seed, **summary}


def _placement(profile: Profile, tau: int | None, l_agent: int | None) -> PlacementConfig:
    base = PlacementConfig(page_tokens=profile.page_tokens)
    pairs = (("tau_tokens", tau), ("l_agent_tokens", l_agent))
    changes: dict[str, Any] = {k: v for k, v in pairs if v}
    return dataclasses.replace(base, **changes)


class _Progress:
    """A tqdm bar over runs (and, for a single long run, over its requests)."""

    def __init__(self, enabled: bool, runs: int, requests: int) -> None:
        self.bar = None
        self.per_request = enabled and runs == 1
        if enabled:
            from tqdm import tqdm  # optional at import time: only the CLI and sweeps need it

            total = requests if self.per_request else runs
            self.bar = tqdm(total=total, unit="req" if self.per_request else "run", leave=False)

    def request(self) -> None:
        if self.bar is not None and self.per_request:
            self.bar.update()

    def run_done(self, label: str) -> None:
        if self.bar is not None and not self.per_request:
            self.bar.set_postfix_str(label)
            self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _sweep(
    kind: str,
    cases: Sequence[tuple[Any, TracePages, PlacementConfig | None, float | None]],
    systems: Sequence[str],
    profile: Profile,
    seeds: Sequence[int],
    arrival_mode: str,
    progress: bool,
    config: dict[str, Any],
) -> dict[str, Any]:
    total = len(cases) * len(systems) * len(seeds)
    bar = _Progress(progress, total, len(cases[0][1]) if cases else 0)
    runs: list[dict[str, Any]] = []
    try:
        for x, pages, placement, qps in cases:
            for system in systems:
                for seed in seeds:
                    run = run_one(
                        pages,
                        profile,
                        system,
                        qps=qps,
                        seed=seed,
                        placement=placement,
                        arrival_mode=arrival_mode,
                        on_request=bar.request,
                    )
                    runs.append({**run, "x": x})
                    bar.run_done(f"{system} {kind}={x}")
    finally:
        bar.close()
    return {
        "kind": kind,
        "x_name": kind,
        "config": {**config, "profile": profile.to_dict(), "seeds": list(seeds)},
        "runs": runs,
        "summary": _summaries(runs),
    }


def _summaries(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["system"], run["x"]), []).append(run)
    return [
        {"system": system, "x": x, "seeds": len(group), **aggregate(group)}
        for (system, x), group in groups.items()
    ]


def run_comparison(
    trace: TraceSource,
    systems: Sequence[str] = DEFAULT_SYSTEMS,
    profile: str | Profile = "this-machine",
    qps: Sequence[float | None] = (None,),
    seeds: Sequence[int] = (0,),
    *,
    profile_overrides: dict[str, Any] | None = None,
    capacity_scale: float = 1.0,
    tau_tokens: int | None = None,
    l_agent_tokens: int | None = None,
    arrival_mode: str = "jitter",
    limit: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Compare ``systems`` on one trace at each load in ``qps`` (None: the trace's own rate),
    over ``seeds``: the paper's Figure 6 shape."""
    for name in systems:
        get_system(name)
    resolved = get_profile(profile, profile_overrides, capacity_scale)
    pages = build_pages(as_trace(trace, limit), resolved.page_tokens)
    placement = _placement(resolved, tau_tokens, l_agent_tokens)
    cases = [(q, pages, placement, q) for q in qps]
    config = _config(trace, systems, arrival_mode, capacity_scale, placement, pages)
    return _sweep("qps", cases, systems, resolved, seeds, arrival_mode, progress, config)


def run_placement_sweep(
    trace: TraceSource,
    parameter: str,
    values: Sequence[int],
    systems: Sequence[str] = ("flatcake",),
    profile: str | Profile = "this-machine",
    qps: float | None = None,
    seeds: Sequence[int] = (0,),
    *,
    profile_overrides: dict[str, Any] | None = None,
    capacity_scale: float = 1.0,
    arrival_mode: str = "jitter",
    limit: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Sensitivity to ``tau_tokens`` or ``l_agent_tokens`` (the paper gives no values)."""
    if parameter not in ("tau_tokens", "l_agent_tokens"):
        raise ConfigError("parameter must be tau_tokens or l_agent_tokens")
    resolved = get_profile(profile, profile_overrides, capacity_scale)
    pages = build_pages(as_trace(trace, limit), resolved.page_tokens)
    base = PlacementConfig(page_tokens=resolved.page_tokens)
    cases = [(v, pages, _with(base, parameter, int(v)), qps) for v in values]
    config = _config(trace, systems, arrival_mode, capacity_scale, base, pages)
    return _sweep(parameter, cases, systems, resolved, seeds, arrival_mode, progress, config)


def run_context_sweep(
    lengths: Sequence[int],
    systems: Sequence[str] = ("recompute", "dram-only", "tiered", "tiered-gds", "flatcake"),
    profile: str | Profile = "llama-3.1-70b-a100",
    seeds: Sequence[int] = (0,),
    *,
    load: float = 0.3,
    turns: int = 8,
    footprint: float = 2.0,
    profile_overrides: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Figure 10: one workload per context length, with enough sessions that their contexts
    add up to ``footprint`` x (HBM + DRAM), offered at ``load`` x what an ideal flat store
    sustains: a session's first turn is a full prefill, each later one the longer of
    restoring the context from SSD and prefilling its new tokens."""
    resolved = get_profile(profile, profile_overrides)
    rank_cache = resolved.hbm_kv_bytes + resolved.dram_rank_bytes
    cases = []
    for length in lengths:
        context_bytes = length * resolved.kv_bytes_per_token
        sessions = max(4, int(footprint * rank_cache / context_bytes) + 1)
        restore_s = context_bytes / (resolved.ssd_worker_bytes_per_s * resolved.ssd_workers)
        later = max(restore_s, resolved.prefill_seconds(512, length))
        first = resolved.prefill_seconds(length, 0)
        trace = context_length_trace(
            length, sessions, turns, first_gap_s=first / load, gap_s=later / load
        )
        pages = build_pages(trace, resolved.page_tokens)
        cases.append((length, pages, None, None))  # the trace's own clock sets the load
    config = {"workload": "context-length", "lengths": list(lengths), "load": load}
    return _sweep("context", cases, systems, resolved, seeds, "jitter", progress, config)


def _config(
    trace: Any,
    systems: Sequence[str],
    arrival_mode: str,
    capacity_scale: float,
    placement: PlacementConfig,
    pages: TracePages,
) -> dict[str, Any]:
    return {
        "trace": str(trace) if isinstance(trace, str | Path) else type(trace).__name__,
        "requests": len(pages),
        "pages": pages.total_pages,
        "reuse_ceiling": float(pages.reusable.sum() / max(pages.total_pages, 1)),
        "systems": list(systems),
        "arrival_mode": arrival_mode,
        "capacity_scale": capacity_scale,
        "placement": dataclasses.asdict(placement),
    }


def _with(base: PlacementConfig, parameter: str, value: int) -> PlacementConfig:
    changes: dict[str, Any] = {parameter: value}
    return dataclasses.replace(base, **changes)
