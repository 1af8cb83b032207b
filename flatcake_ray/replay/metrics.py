"""Per-request records of a run, the run's summary, and aggregation over seeds.

Definitions (one run):

- ``hit_rate``: delivered hits / reusable pages, where a page is *delivered* when it is in
  HBM before its request's prefill (already there, or copied from DRAM, or read from SSD),
  and *reusable* when an infinite cache would hold it (an earlier request had it).
  ``hit_rate_hbm/dram/ssd`` split it by where the page came from; with ``miss_rate`` they sum
  to 1. ``hit_rate_of_all`` and ``reuse_ceiling`` use all pages as the denominator (the
  paper's Figure 6(d) convention: FlatCake 94.2% against a 94.7% ceiling).
- ``ttft_*``: prefill end - arrival (seconds); decode is not modelled.
- ``throughput_tokens_s``: (prompt + output tokens) / (last prefill end - first arrival).
- ``ssd_read_amplification``: SSD bytes read (restores and promotions) / SSD bytes delivered.
- ``ssd_write_amplification``: SSD bytes written / distinct pages ever written x page size.
- ``ssd_read_gb_s_per_worker``: read bytes / read busy time, per worker (Figure 8(a));
  ``ssd_read_gb_s``: read bytes / run span.
- ``prefetch_latency_s``: arrival -> SSD data in, over requests that read SSD (queueing for
  a window or staging included); ``prefetch_io_s``: read start -> data in.
- ``misplaced_rate`` (FlatCake only): written pages on a medium the oracle would not pick
  (homed on DRAM yet not read within the oracle's horizon, or only on SSD though read
  within it) / written pages; ``never_reused_rate``: written pages never read again;
  ``replica_hit_rate``: hits served by DRAM read replicas / reusable pages.
- ``class_<c>_hit_rate`` / ``class_<c>_ttft_mean_s``: per session class, when the trace's
  session names carry one (the synthetic mixed trace: agentic, chat, switch).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


class RequestRecords:
    def __init__(self, count: int) -> None:
        def times() -> np.ndarray:
            return np.full(count, math.nan)

        def pages() -> np.ndarray:
            return np.zeros(count, dtype=np.int64)

        self.arrival, self.dispatch, self.done = times(), times(), times()
        self.compute_s, self.prefetch_wait, self.prefetch_io = times(), times(), times()
        self.hbm, self.dram, self.ssd, self.miss, self.late = (pages() for _ in range(5))
        self.revoked = np.zeros(count, dtype=bool)
        self.ssd_commands = pages()  # SSD read commands of its restores

    @property
    def ttft(self) -> np.ndarray:
        return self.done - self.arrival


def _ratio(numerator: float, denominator: float) -> float:
    return float(numerator / denominator) if denominator else 0.0


def _stat(values: np.ndarray, fn: str) -> float:
    values = values[~np.isnan(values)]
    if not values.size:
        return 0.0
    if fn == "mean":
        return float(values.mean())
    return float(np.percentile(values, float(fn[1:])))


def summarize(replay: Any, wall_s: float) -> dict[str, Any]:
    """One run's metrics (see the module docstring)."""
    records, pages, counters = replay.records, replay.pages, replay.counters
    reusable = float(pages.reusable.sum())
    hits = records.hbm.sum() + records.dram.sum() + records.ssd.sum()
    ttft = records.ttft
    span = float(np.nanmax(records.done) - np.nanmin(records.arrival)) if len(ttft) else 0.0
    tokens = float(pages.prompt_tokens.sum() + pages.output_tokens.sum())
    read_bytes = counters["ssd_read_bytes_restore"] + counters["ssd_read_bytes_promotion"]
    distinct_written = counters["ssd_pages_written_distinct"] * replay.page_bytes
    reads = replay.ssd.reads
    workers = len(replay.ssd.free_at)
    return {
        "requests": len(ttft),
        "pages": int(pages.total_pages),
        "reusable_pages": int(reusable),
        "hit_rate": _ratio(hits, reusable),
        "hit_rate_hbm": _ratio(records.hbm.sum(), reusable),
        "hit_rate_dram": _ratio(records.dram.sum(), reusable),
        "hit_rate_ssd": _ratio(records.ssd.sum(), reusable),
        "miss_rate": _ratio(records.miss.sum(), reusable),
        "hit_rate_of_all": _ratio(hits, pages.total_pages),
        "reuse_ceiling": _ratio(reusable, pages.total_pages),
        "late_hit_pages": int(records.late.sum()),
        "ttft_mean_s": _stat(ttft, "mean"),
        "ttft_p50_s": _stat(ttft, "p50"),
        "ttft_p99_s": _stat(ttft, "p99"),
        "throughput_tokens_s": _ratio(tokens, span),
        "span_s": span,
        "ssd_read_amplification": _ratio(read_bytes, counters["ssd_bytes_delivered"]),
        "ssd_write_amplification": _ratio(counters["ssd_write_bytes"], distinct_written),
        "ssd_read_gb_s_per_worker": _ratio(reads.bytes, reads.busy_s) / 1e9,
        "ssd_read_gb_s": _ratio(reads.bytes, span) / 1e9,
        "ssd_read_commands": reads.commands,
        "ssd_read_bytes": read_bytes,
        "ssd_write_commands": replay.ssd.writes.commands,
        "ssd_worker_utilisation": _ratio(reads.busy_s + replay.ssd.writes.busy_s, span * workers),
        "prefetch_latency_s": _stat(records.prefetch_wait, "mean"),
        "prefetch_io_s": _stat(records.prefetch_io, "mean"),
        "revoked_requests": counters["revoked_requests"],
        "revoked_pages": counters["revoked_pages"],
        **_placement_scores(replay.storage.counters.values, reusable),
        **_by_class(records, pages),
        "wall_s": wall_s,
        "storage": replay.storage.report(),
        "scheduler": _scheduler_stats(replay.scheduler),
        "counters": dict(counters),
    }


def _placement_scores(counters: dict[str, int], reusable: float) -> dict[str, float]:
    """FlatCake's placement against the oracle's choice (``FlatStorage``): the share of
    written pages on a medium the oracle would not pick, and of pages never read again."""
    scored = counters.get("pages_scored", 0)
    misplaced = counters.get("pages_dram_not_soon", 0) + counters.get("pages_ssd_only_soon", 0)
    return {
        "misplaced_rate": _ratio(misplaced, scored),
        "never_reused_rate": _ratio(counters.get("pages_never_reused", 0), scored),
        "replica_hit_rate": _ratio(counters.get("replica_hit_pages", 0), reusable),
    }


def _by_class(records: RequestRecords, pages: Any) -> dict[str, float]:
    """Hit rate and mean TTFT per session class, for traces whose session names say their
    class (``agentic-3``, ``chat-12``, ``switch-1``: the synthetic mixed trace)."""
    names = pages.session_names
    classes = sorted({n.split("-")[0] for n in names if "-" in n})
    if len(classes) < 2:
        return {}
    of_session = np.array([n.split("-")[0] for n in names] + [""])  # -1 (no session) -> ""
    of_request = of_session[pages.sessions]
    hits = records.hbm + records.dram + records.ssd
    out: dict[str, float] = {}
    for name in classes:
        chosen = of_request == name
        out[f"class_{name}_hit_rate"] = _ratio(hits[chosen].sum(), pages.reusable[chosen].sum())
        out[f"class_{name}_ttft_mean_s"] = _stat(records.ttft[chosen], "mean")
    return out


def _scheduler_stats(scheduler: Any) -> dict[str, float]:
    stats = scheduler.stats()
    return {
        "prefetches_started": stats.prefetches_started,
        "dispatched_dram": stats.dispatched_dram,
        "dispatched_ssd": stats.dispatched_ssd,
        "max_inflight_prefetches_seen": stats.max_inflight_prefetches_seen,
        "mean_wait_dram_s": stats.mean_wait_dram,
        "mean_wait_ssd_s": stats.mean_wait_ssd,
    }


def aggregate(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """mean / std / min / max over seeds of every scalar metric."""
    skip = ("seed", "x", "qps")
    scalars = [k for k, v in runs[0].items() if isinstance(v, int | float) and k not in skip]
    out: dict[str, dict[str, float]] = {}
    for key in scalars:
        values = np.array([run[key] for run in runs], dtype=float)
        out[key] = {
            "mean": float(values.mean()),
            "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
            "min": float(values.min()),
            "max": float(values.max()),
        }
    return out
