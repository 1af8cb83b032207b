"""Workload inputs for the replay: loading traces, arrival processes, a context-length trace.

Arrival modes (``qps`` is the target mean rate; the request *order* never changes):

- ``jitter`` (default): the trace's own gaps rescaled to ``qps``, each multiplied by a
  Gamma(4, 1/4) factor (mean 1, CV 0.5) drawn from ``seed``: bursts (sub-agent fan-outs) stay
  bursts, and seeds differ.
- ``scaled``: the trace's gaps rescaled, nothing random (seeds give identical runs).
- ``poisson``: exponential gaps at ``qps``, ignoring the trace's timing.
- ``spread``: ``scaled``, with requests that share a timestamp spread evenly over the gap to
  the next one (a trace whose clock ticks coarser than its requests arrive: the Mooncake
  traces' timestamps are 3 s apart); the last tick's requests get the mean gap.

A trace whose span is zero (all at one instant) is replayed as ``poisson`` at ``qps``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from flatcake_ray.errors import ConfigError
from flatcake_ray.replay.pages import TracePages
from flatcake_ray.traces.infer import with_inferred_sessions
from flatcake_ray.traces.readers import load_trace
from flatcake_ray.traces.records import NO_VALUE, Trace, TraceRequest, frozen_blocks

ARRIVAL_MODES = ("jitter", "scaled", "poisson", "spread")


def as_trace(
    source: Trace | Iterable[TraceRequest] | str | Path, limit: int | None = None
) -> Trace:
    """A :class:`Trace` from a trace, requests or a file; sessions inferred when it has none
    (so the model can give the engine's turn and prior-reply hints)."""
    if isinstance(source, str | Path):
        trace = load_trace(source)
    elif isinstance(source, Trace):
        trace = source
    else:
        trace = Trace.from_requests(source)
    if limit is not None and limit < len(trace):
        trace = Trace.from_requests(trace[i] for i in range(limit))
    if len(trace) and (trace.session_codes == NO_VALUE).all():
        trace = with_inferred_sessions(trace)
    return trace


def arrivals_for(
    pages: TracePages, qps: float | None, seed: int, mode: str = "jitter"
) -> np.ndarray:
    if mode not in ARRIVAL_MODES:
        raise ConfigError(f"arrival mode must be one of {ARRIVAL_MODES}, got {mode!r}")
    base = pages.base_arrival
    count = len(base)
    if qps is not None and not qps > 0:
        raise ConfigError(f"qps must be > 0, got {qps}")
    if count == 0:
        return base.copy()
    span = float(base[-1])
    rng = np.random.default_rng(seed)
    if mode == "poisson" or (span <= 0 and qps is not None):
        gaps = rng.exponential(1.0 / qps, count) if qps else np.zeros(count)
        gaps[0] = 0.0
        return np.cumsum(gaps)
    scale = 1.0 if qps is None or span <= 0 else (count - 1) / span / qps
    if mode == "spread":
        return spread_ties(base) * scale
    gaps = np.diff(base, prepend=0.0) * scale
    if mode == "jitter":
        gaps *= rng.gamma(4.0, 0.25, count)
    return np.cumsum(gaps)


def spread_ties(times: np.ndarray) -> np.ndarray:
    """Sorted ``times`` with each run of equal values spread evenly over the gap to the next
    distinct value (the last run over the mean gap between distinct values)."""
    ticks, first, counts = np.unique(times, return_index=True, return_counts=True)
    gaps = np.diff(ticks, append=ticks[-1] + (np.diff(ticks).mean() if len(ticks) > 1 else 0))
    rank = np.arange(len(times)) - np.repeat(first, counts)
    return times + rank * np.repeat(gaps / counts, counts)


def context_length_trace(
    context_tokens: int,
    sessions: int,
    turns: int = 4,
    new_tokens: int = 512,
    block_tokens: int = 64,
    output_tokens: int = 256,
    first_gap_s: float = 1.0,
    gap_s: float = 1.0,
) -> Trace:
    """Figure 10's workload: ``sessions`` conversations of ``turns`` requests, each request
    ``context_tokens`` long, of which all but the last ``new_tokens`` are the session's shared
    context (its first turn computes it all). Sessions take turns round-robin, so a session's
    reuse distance is ``sessions`` requests. First turns arrive ``first_gap_s`` apart, later
    ones ``gap_s`` apart (a first turn is a full prefill, so it needs a wider gap).
    """
    if context_tokens <= new_tokens or sessions < 1 or turns < 1:
        raise ConfigError("need context_tokens > new_tokens, sessions >= 1, turns >= 1")
    shared_blocks = (context_tokens - new_tokens) // block_tokens
    tail_blocks = -(-new_tokens // block_tokens)
    requests = []
    next_id = sessions * shared_blocks
    clock = 0.0
    for turn in range(turns):
        for session in range(sessions):
            clock += first_gap_s if turn == 0 else gap_s
            shared = np.arange(shared_blocks) + session * shared_blocks
            tail = np.arange(tail_blocks) + next_id
            next_id += tail_blocks
            requests.append(
                TraceRequest(
                    arrival_s=clock,
                    session=f"ctx-{session}",
                    turn=turn + 1,
                    blocks=frozen_blocks(np.concatenate([shared, tail])),
                    input_tokens=context_tokens,
                    output_tokens=output_tokens,
                    block_tokens=block_tokens,
                )
            )
    return Trace.from_requests(requests)
