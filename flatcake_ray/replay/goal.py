"""The goal of issue 14, checked cell by cell on sweep results.

On every (trace, profile, capacity, load) cell, FlatCake must have

- a hit rate within ``hit_points`` (0.5) percentage points of the best system (oracle
  included), and
- a TTFT mean and P99 at most ``ttft_slack`` (2%) above the best *other* system that is not
  the oracle (FlatCake's own variants, e.g. ``flatcake-table2``, count as other systems),

all as means over seeds. :func:`goal_rows` computes the comparison, :func:`goal_table`
renders it (one row per cell; a failed criterion is marked **no**).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

FLAT = "flatcake"
ORACLE = "oracle"
COLLAPSING = "tiered"  # the revoking Mooncake-like baseline whose collapse the paper shows


@dataclass(frozen=True)
class Best:
    system: str
    mean: float
    std: float


@dataclass(frozen=True)
class GoalRow:
    cell: str
    x: Any
    hit: Best  # FlatCake's
    best_hit: Best
    ttft: Best
    best_ttft: Best
    p99: Best
    best_p99: Best
    read_amp: float
    misplaced: float
    oracle_ttft: float | None
    collapsed: Best | None  # the revoking tiered baseline, where it is in the cell

    @property
    def hit_ok(self) -> bool:
        return self.hit.mean >= self.best_hit.mean - 0.005

    @property
    def ttft_ok(self) -> bool:
        return self.ttft.mean <= 1.02 * self.best_ttft.mean

    @property
    def p99_ok(self) -> bool:
        return self.p99.mean <= 1.02 * self.best_p99.mean

    @property
    def met(self) -> bool:
        return self.hit_ok and self.ttft_ok and self.p99_ok


def _entry(row: dict[str, Any], key: str) -> Best:
    return Best(row["system"], row[key]["mean"], row[key]["std"])


def goal_rows(cell: str, result: dict[str, Any]) -> list[GoalRow]:
    """One row per x of a comparison result that has a ``flatcake`` run."""
    by_x: dict[Any, dict[str, dict[str, Any]]] = {}
    for row in result["summary"]:
        by_x.setdefault(row["x"], {})[row["system"]] = row
    rows = []
    for x, systems in by_x.items():
        flat = systems.get(FLAT)
        if flat is None:
            continue
        others = [r for name, r in systems.items() if name not in (FLAT, ORACLE)]
        if not others:
            continue
        best_hit = max((_entry(r, "hit_rate") for r in systems.values()), key=lambda b: b.mean)
        best_ttft = min((_entry(r, "ttft_mean_s") for r in others), key=lambda b: b.mean)
        best_p99 = min((_entry(r, "ttft_p99_s") for r in others), key=lambda b: b.mean)
        oracle = systems.get(ORACLE)
        collapsing = systems.get(COLLAPSING)
        rows.append(
            GoalRow(
                cell,
                x,
                _entry(flat, "hit_rate"),
                best_hit,
                _entry(flat, "ttft_mean_s"),
                best_ttft,
                _entry(flat, "ttft_p99_s"),
                best_p99,
                flat["ssd_read_amplification"]["mean"],
                flat.get("misplaced_rate", {}).get("mean", 0.0),
                oracle["ttft_mean_s"]["mean"] if oracle else None,
                _entry(collapsing, "hit_rate") if collapsing else None,
            )
        )
    return sorted(rows, key=lambda r: (r.cell, float("-inf") if r.x is None else float(r.x)))


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _pm(best: Best, scale: float, digits: int) -> str:
    text = f"{best.mean * scale:.{digits}f}"
    return text + (f" ±{best.std * scale:.{digits}f}" if best.std else "")


def goal_table(rows: Iterable[GoalRow]) -> str:
    header = (
        "| cell | load | hit % flatcake | best hit % (system) | ok | TTFT mean s flatcake "
        "| best other (system) | ratio | ok | P99 s flatcake | best other (system) | ratio "
        "| ok | vs oracle TTFT | tiered hit % | read amp | misplaced % |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        ratio = r.ttft.mean / r.best_ttft.mean if r.best_ttft.mean else float("nan")
        p99_ratio = r.p99.mean / r.best_p99.mean if r.best_p99.mean else float("nan")
        vs_oracle = f"{r.ttft.mean / r.oracle_ttft:.3f}" if r.oracle_ttft else "-"
        tiered = _pm(r.collapsed, 100, 1) if r.collapsed else "-"
        cells = [
            r.cell,
            "trace" if r.x is None else f"{r.x:g}",
            _pm(r.hit, 100, 2),
            f"{100 * r.best_hit.mean:.2f} ({r.best_hit.system})",
            _yes(r.hit_ok),
            _pm(r.ttft, 1, 3),
            f"{r.best_ttft.mean:.3f} ({r.best_ttft.system})",
            f"{ratio:.3f}",
            _yes(r.ttft_ok),
            _pm(r.p99, 1, 2),
            f"{r.best_p99.mean:.2f} ({r.best_p99.system})",
            f"{p99_ratio:.3f}",
            _yes(r.p99_ok),
            vs_oracle,
            tiered,
            f"{r.read_amp:.2f}",
            f"{100 * r.misplaced:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
