"""A sweep's result as files: ``result.json``, ``results.md`` (one table), and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLUMNS = (
    ("hit %", "hit_rate", 100.0, 1),
    ("HBM %", "hit_rate_hbm", 100.0, 1),
    ("DRAM %", "hit_rate_dram", 100.0, 1),
    ("SSD %", "hit_rate_ssd", 100.0, 1),
    ("TTFT mean s", "ttft_mean_s", 1.0, 2),
    ("P50 s", "ttft_p50_s", 1.0, 2),
    ("P99 s", "ttft_p99_s", 1.0, 2),
    ("tok/s", "throughput_tokens_s", 1.0, 0),
    ("read amp", "ssd_read_amplification", 1.0, 2),
    ("write amp", "ssd_write_amplification", 1.0, 3),
    ("SSD GB/s/worker", "ssd_read_gb_s_per_worker", 1.0, 2),
    ("SSD cmds", "ssd_read_commands", 1.0, 0),
    ("prefetch s", "prefetch_latency_s", 1.0, 2),
    ("revoked", "revoked_requests", 1.0, 0),
)


CLASS_COLUMNS = tuple(
    (f"{name} {title}", f"class_{name}_{key}", scale, digits)
    for name in ("agentic", "chat", "switch")
    for title, key, scale, digits in (
        ("hit %", "hit_rate", 100.0, 1),
        ("TTFT s", "ttft_mean_s", 1.0, 2),
    )
)


def _cell(entry: dict[str, float], scale: float, digits: int, spread: bool) -> str:
    mean = entry["mean"] * scale
    text = f"{mean:,.{digits}f}"
    if spread and entry["std"] > 0:
        text += f" ±{entry['std'] * scale:,.{digits}f}"
    return text


def markdown_table(result: dict[str, Any], columns: tuple = COLUMNS) -> str:
    """One row per (system, x): means over seeds, ± the sample std where seeds differ."""
    x_name = result["x_name"]
    columns = tuple(c for c in columns if all(c[1] in row for row in result["summary"]))
    header = ["system", x_name, "seeds", *(title for title, *_ in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows = sorted(result["summary"], key=lambda s: (_sort_key(s["x"]), s["system"]))
    spread = any(row["seeds"] > 1 for row in rows)
    for row in rows:
        cells = [row["system"], _x_text(row["x"]), str(row["seeds"])]
        cells += [_cell(row[key], scale, digits, spread) for _, key, scale, digits in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def merge_results(
    result: dict[str, Any], other: dict[str, Any], systems: tuple[str, ...]
) -> dict[str, Any]:
    """``result`` plus the runs of ``systems`` from ``other`` at the same x values (one
    table of variants measured beside runs made for another table)."""
    xs = {row["x"] for row in result["summary"]}
    chosen = [r for r in other["summary"] if r["system"] in systems and r["x"] in xs]
    runs = [r for r in other["runs"] if r["system"] in systems and r["x"] in xs]
    return {**result, "summary": result["summary"] + chosen, "runs": result["runs"] + runs}


def _sort_key(x: Any) -> float:
    return float("-inf") if x is None else float(x)


def _x_text(x: Any) -> str:
    return "trace" if x is None else f"{x:g}"


def write_outputs(result: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write the JSON, the markdown table and the plots; returns their paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "result.json", "markdown": out / "results.md"}
    paths["json"].write_text(json.dumps(result, indent=1, default=_jsonable))
    paths["markdown"].write_text(markdown_table(result))
    from flatcake_ray.replay.plots import plot_result  # matplotlib only when plots are asked for

    paths.update(plot_result(result, out))
    return paths


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, set | tuple):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
