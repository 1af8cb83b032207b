"""The model's half of ``flatcake-ray replay --live``: the same requests, arrivals and node
stores through the replay model, and the side-by-side table of measured and predicted.

The model replays each node's share of the trace on its own engine and catalog (a node of the
service is one store; a request is served by its node's client), the catalog built from that
node's live store config, so placement, allocation, reclamation, coalescing and the restore
plan are the service's own code with the service's own sizes. What the model adds is devices
and a clock: its profile has no HBM prefix cache (the live driver keeps none), no compute (it
runs no model), and the device constants of this machine (``--measure``) or the profile's.

Measured and predicted, per metric (``docs/bench_replay.md`` has a run):

- hit pages and hit rate by medium (of the reusable pages of the whole trace);
- SSD read commands and bytes, read amplification (bytes read / page bytes delivered);
- restore time per request that hit (P50/P99): live, ``restore_report`` end to end (lookup,
  lease, reads, checks, scatter, release); the model, its SSD prefetch I/O plus its DRAM
  pages' copy; and the data part alone (live: the transports' seconds), which is what the
  model describes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from flatcake_ray.config import StoreConfig
from flatcake_ray.errors import ConfigError
from flatcake_ray.replay.engine import Replay
from flatcake_ray.replay.pages import TracePages, select_requests
from flatcake_ray.replay.profiles import Profile, get_profile
from flatcake_ray.replay.systems import get_system

COUNT_BOUND = 0.05  # hit rates and read commands: the model within 5%
TIME_BOUND = 0.25  # times: within 25%
NO_COMPUTE = {"prefill_tokens_per_s": 1e15, "attention_pairs_per_s": 1e18}


def live_profile(
    base: str, layers: int, page_bytes: int, page_tokens: int, **changes: Any
) -> Profile:
    """The model of one live node: its page geometry, no HBM, no compute; ``changes`` on top
    (device constants from ``--measure``, ``--set``, the client's slot and windows)."""
    per_token, rest = divmod(page_bytes * layers, page_tokens)
    if rest:
        raise ConfigError(f"page_bytes x layers must be a multiple of page_tokens ({page_tokens})")
    overrides = {
        "layers": layers,
        "page_tokens": page_tokens,
        "kv_bytes_per_token": per_token,
        "hbm_kv_bytes": 0,
        "prefill_overhead_ms": 0.0,  # the model meets requests when the live node began them
        **NO_COMPUTE,
        **changes,
    }
    return get_profile(base, overrides)


def predict(
    pages: TracePages,
    arrivals: np.ndarray,
    node_of: np.ndarray,
    stores: dict[int, StoreConfig],
    profile: Profile,
    system: str = "flatcake",
) -> dict[str, Any]:
    """Per-request predictions (arrays over the whole trace) and the model's counters."""
    count = len(pages)
    out = {name: np.zeros(count) for name in ("dram_pages", "ssd_pages", "ssd_commands")}
    out["restore_s"], out["ssd_seconds"] = np.zeros(count), np.zeros(count)
    counters: dict[str, int] = {}
    for slot, store in stores.items():
        requests = np.flatnonzero(node_of == slot)
        if not requests.size:
            continue
        share = select_requests(pages, requests)
        replay = Replay(share, arrivals[requests], profile, get_system(system), None, store)
        records = replay.run()
        out["dram_pages"][requests] = records.dram
        out["ssd_pages"][requests] = records.ssd
        out["ssd_commands"][requests] = records.ssd_commands
        copy = records.dram * profile.page_all_layers_bytes / (profile.h2d_gb_s * 1e9)
        out["ssd_seconds"][requests] = np.nan_to_num(records.prefetch_io)
        fixed = (records.dram + records.ssd > 0) * profile.restore_overhead_ms / 1e3
        out["restore_s"][requests] = out["ssd_seconds"][requests] + copy + fixed
        for key, value in replay.counters.items():
            counters[key] = counters.get(key, 0) + int(value)
    return {**out, "counters": counters}


def measured_arrays(records: list[dict[str, Any]], count: int) -> dict[str, np.ndarray]:
    fields = ("dram_pages", "ssd_pages", "ssd_commands", "ssd_bytes", "ssd_seconds")
    out = {name: np.zeros(count) for name in (*fields, "restore_s", "remote_pages")}
    for record in records:
        for name in out:
            out[name][record["request"]] = record.get(name, 0.0)
    return out


def _relative(measured: float, predicted: float) -> float | None:
    if predicted == 0:
        return 0.0 if measured == 0 else None
    return (measured - predicted) / predicted


def _row(name: str, measured: float, predicted: float, bound: float | None) -> dict[str, Any]:
    error = _relative(measured, predicted)
    within = None if bound is None else error is not None and abs(error) <= bound
    return {
        "metric": name,
        "measured": measured,
        "predicted": predicted,
        "relative_error": error,
        "bound": bound,
        "within": within,
    }


def comparison(
    pages: TracePages, live: dict[str, np.ndarray], model: dict[str, Any], page_all_bytes: int
) -> list[dict[str, Any]]:
    """The side-by-side rows (see the module doc)."""
    reusable = max(1, int(pages_reusable(pages)))
    rows = []
    for medium in ("dram", "ssd"):
        hits_live = float(live[f"{medium}_pages"].sum())
        hits_model = float(model[f"{medium}_pages"].sum())
        rows.append(_row(f"hit pages, {medium.upper()}", hits_live, hits_model, None))
        rows.append(
            _row(
                f"hit rate, {medium.upper()}",
                hits_live / reusable,
                hits_model / reusable,
                COUNT_BOUND,
            )
        )
    total_live = float(live["dram_pages"].sum() + live["ssd_pages"].sum())
    total_model = float(model["dram_pages"].sum() + model["ssd_pages"].sum())
    rows.append(_row("hit rate, all", total_live / reusable, total_model / reusable, COUNT_BOUND))
    rows.append(
        _row(
            "SSD read commands",
            float(live["ssd_commands"].sum()),
            float(model["ssd_commands"].sum()),
            COUNT_BOUND,
        )
    )
    read_live = float(live["ssd_bytes"].sum())
    read_model = float(model["counters"].get("ssd_read_bytes_restore", 0))
    rows.append(_row("SSD bytes read", read_live, read_model, COUNT_BOUND))
    delivered_live = max(1.0, float(live["ssd_pages"].sum()) * page_all_bytes)
    delivered_model = max(1.0, float(model["ssd_pages"].sum()) * page_all_bytes)
    rows.append(
        _row(
            "SSD read amplification",
            read_live / delivered_live,
            read_model / delivered_model,
            COUNT_BOUND,
        )
    )
    return rows + time_rows(live, model)


def time_rows(live: dict[str, np.ndarray], model: dict[str, Any]) -> list[dict[str, Any]]:
    """Restore times per request that hit on both sides, end to end; and the SSD reads alone
    (requests that read SSD on both sides)."""
    hit = (live["dram_pages"] + live["ssd_pages"] > 0) & (
        model["dram_pages"] + model["ssd_pages"] > 0
    )
    read = (live["ssd_pages"] > 0) & (model["ssd_pages"] > 0)
    cases = (
        ("restore time", live["restore_s"], model["restore_s"], hit),
        ("SSD read time", live["ssd_seconds"], model["ssd_seconds"], read),
    )
    rows = []
    for label, measured, predicted, chosen in cases:
        for q in (50, 99):
            pair = _percentile(measured[chosen], q), _percentile(predicted[chosen], q)
            rows.append(_row(f"{label} P{q} (s)", *pair, TIME_BOUND))
    return rows


def pages_reusable(pages: TracePages) -> int:
    return int(pages.reusable.sum())


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else 0.0


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| metric | measured | predicted | relative error | bound | within |",
        "|---|---:|---:|---:|---:|:---:|",
    ]
    for row in rows:
        error, bound, within = row["relative_error"], row["bound"], row["within"]
        cells = [
            row["metric"],
            _fmt(row["measured"]),
            _fmt(row["predicted"]),
            "n/a" if error is None else f"{error:+.1%}",
            "" if bound is None else f"{bound:.0%}",
            "" if within is None else ("yes" if within else "NO"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: float) -> str:
    if value == int(value) and abs(value) >= 1:
        return f"{int(value):,}"
    return f"{value:.4g}"


def write_plots(live: dict[str, np.ndarray], model: dict[str, Any], folder: Any) -> list[Any]:
    """Restore time per request (CDF) and hit pages by medium, measured beside predicted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    hit = live["dram_pages"] + live["ssd_pages"] > 0
    figure, axis = plt.subplots(figsize=(6, 4))
    for label, values in (("measured", live["restore_s"][hit]), ("model", model["restore_s"][hit])):
        ordered = np.sort(values) * 1e3
        axis.plot(ordered, np.linspace(0, 1, len(ordered)), label=label)
    axis.set(xlabel="restore time per request (ms)", ylabel="fraction of requests", xscale="log")
    axis.legend()
    paths.append(folder / "restore_time_cdf.png")
    figure.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(figure)
    figure, axis = plt.subplots(figsize=(6, 4))
    media = ("dram_pages", "ssd_pages")
    x = np.arange(len(media))
    axis.bar(x - 0.2, [live[m].sum() for m in media], 0.4, label="measured")
    axis.bar(x + 0.2, [model[m].sum() for m in media], 0.4, label="model")
    axis.set_xticks(x, ["DRAM hits", "SSD hits"])
    axis.set(ylabel="pages")
    axis.legend()
    paths.append(folder / "hits_by_medium.png")
    figure.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(figure)
    return paths


def as_json(value: Any) -> Any:
    """JSON-ready (numpy scalars and dataclasses made plain)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return as_json(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
