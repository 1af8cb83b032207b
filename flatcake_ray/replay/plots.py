"""PNG plots of a sweep (matplotlib, Agg backend: no display needed).

- ``overview.png``: the paper's Figure 6 panels against the sweep's x (mean TTFT, P50 TTFT,
  token throughput, delivered hit rate), one line per system, error bars = std over seeds.
- ``hits_by_medium.png``: Figure 7, stacked HBM / DRAM / SSD shares of the hit rate.
- ``ssd.png``: Figures 8 and 9, SSD read GB/s per worker, prefetch latency, read and write
  amplification.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PANELS_OVERVIEW = (
    ("ttft_mean_s", "mean TTFT (s)", 1.0),
    ("ttft_p50_s", "P50 TTFT (s)", 1.0),
    ("throughput_tokens_s", "total tokens/s (10^3)", 1e-3),
    ("hit_rate", "delivered hit rate (%)", 100.0),
)
PANELS_SSD = (
    ("ssd_read_gb_s_per_worker", "SSD read GB/s per worker", 1.0),
    ("prefetch_latency_s", "mean SSD prefetch latency (s)", 1.0),
    ("ssd_read_amplification", "SSD read amplification", 1.0),
    ("ssd_write_amplification", "SSD write amplification", 1.0),
)
MEDIA = (("hit_rate_hbm", "GPU HBM"), ("hit_rate_dram", "host DRAM"), ("hit_rate_ssd", "SSD"))


def _series(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    by_system: dict[str, list[dict[str, Any]]] = {}
    for row in result["summary"]:
        by_system.setdefault(row["system"], []).append(row)
    for rows in by_system.values():
        rows.sort(key=lambda r: -1.0 if r["x"] is None else float(r["x"]))
    return by_system


def _x_values(rows: list[dict[str, Any]]) -> list[float]:
    return [0.0 if r["x"] is None else float(r["x"]) for r in rows]


def _panels(result: dict[str, Any], panels: tuple, path: Path, title: str) -> Path:
    series = _series(result)
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for axis, (key, label, scale) in zip(axes, panels, strict=True):
        values = [r[key]["mean"] for rows in series.values() for r in rows]
        for system, rows in series.items():
            axis.errorbar(
                _x_values(rows),
                [r[key]["mean"] * scale for r in rows],
                yerr=[r[key]["std"] * scale for r in rows],
                marker="o",
                capsize=3,
                label=system,
            )
        axis.set_xlabel(result["x_name"])
        axis.set_ylabel(label)
        if key.startswith(("ttft", "prefetch")) and min(values) > 0:
            axis.set_yscale("log")  # overloaded baselines sit orders of magnitude above
        if result["kind"] in ("context", "l_agent_tokens", "tau_tokens"):
            axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _hits_by_medium(result: dict[str, Any], path: Path) -> Path:
    series = _series(result)
    figure, axes = plt.subplots(1, len(series), figsize=(3.6 * len(series), 3.4), squeeze=False)
    for axis, (system, rows) in zip(axes[0], series.items(), strict=True):
        labels = ["trace" if r["x"] is None else f"{r['x']:g}" for r in rows]
        bottom = [0.0] * len(rows)
        for key, medium in MEDIA:
            heights = [r[key]["mean"] * 100 for r in rows]
            axis.bar(labels, heights, bottom=bottom, label=medium)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        axis.set_title(system)
        axis.set_xlabel(result["x_name"])
        axis.set_ylim(0, 100)
    axes[0][0].set_ylabel("hit rate contribution (%)")
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_result(result: dict[str, Any], out: Path) -> dict[str, Path]:
    title = f"{result['config'].get('profile', {}).get('name', '')}: {result['kind']} sweep"
    return {
        "overview": _panels(result, PANELS_OVERVIEW, out / "overview.png", title),
        "hits_by_medium": _hits_by_medium(result, out / "hits_by_medium.png"),
        "ssd": _panels(result, PANELS_SSD, out / "ssd.png", title),
    }
