"""The side-by-side Markdown tables of a ``benchmarks.peers`` result (and its JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

START, END = "<!-- bench-peers:start -->", "<!-- bench-peers:end -->"
PATHS = ("local DRAM", "remote DRAM", "local SSD", "remote SSD")
COLUMNS = ("flatcake", "flatcake_tcp", "mooncake", "lmcache")
TITLES = {
    "flatcake": "FlatCake (UCX default)",
    "flatcake_tcp": "FlatCake (UCX_TLS=tcp)",
    "mooncake": "Mooncake Store (TCP)",
    "lmcache": "LMCache (one process)",
}
WIRE = {"flatcake": "nixl_default", "flatcake_tcp": "nixl_tcp", "mooncake": "tcp_loopback"}


def limit_of(
    op: str, path: str, column: str, limits: dict[str, float], near: dict[str, float] | None = None
) -> tuple[str, float]:
    """The physical limit (name, GB/s) a cell is measured against: a limit sampled beside
    the cell (``near``, the best of the samples before and after it) where there is one,
    else the run's."""
    limits = {**limits, **(near or {})}
    medium = "odirect_read" if op == "restore" else "odirect_write"
    if path == "local DRAM":
        return "memcpy", limits["memcpy"]
    if path == "local SSD":
        return medium, limits[medium]
    wire = WIRE.get(column, "tcp_loopback")
    if path == "remote DRAM":
        return wire, limits[wire]
    both = min((medium, wire), key=lambda name: limits[name])
    return both, limits[both]


def row_of(results: dict[str, Any], column: str, op: str, path: str) -> dict[str, Any] | None:
    return results.get(column, {}).get(op, {}).get(path)


def cell(results: dict[str, Any], column: str, op: str, path: str) -> float | None:
    row = row_of(results, column, op, path)
    return None if row is None else row["gbps"]


def _fmt(gbps: float | None, limit: float) -> str:
    return "—" if gbps is None else f"{gbps:.2f} ({gbps / limit:.2f})"


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None else f"{a / b:.1f}x"


def throughput_table(results: dict[str, Any], op: str) -> list[str]:
    limits = results["limits"]
    head = ["path", *(TITLES[c] for c in COLUMNS), "FlatCake ÷ Mooncake", "limits (GB/s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    lines[1] = "|---|" + "---:|" * (len(head) - 2) + "---|"
    for path in PATHS:
        cells, used = [], {}
        for column in COLUMNS:
            row = row_of(results, column, op, path)
            name, limit = limit_of(op, path, column, limits, (row or {}).get("limits"))
            if row is not None:
                beside = name in (row.get("limits") or {})
                used[f"{name} beside FlatCake" if beside else name] = limit
            cells.append(_fmt(None if row is None else row["gbps"], limit))
        fc, mc = cell(results, "flatcake", op, path), cell(results, "mooncake", op, path)
        ratio = _ratio(fc, mc)
        fc_tcp = cell(results, "flatcake_tcp", op, path)
        if fc_tcp is not None and mc is not None:
            ratio += f" (TCP both: {_ratio(fc_tcp, mc)})"
        limit_text = ", ".join(f"{n} {v:.2f}" for n, v in used.items())
        lines.append(f"| {path} | " + " | ".join(cells) + f" | {ratio} | {limit_text} |")
    return lines


def control_table(results: dict[str, Any]) -> list[str]:
    pages = results["config"]["pages"]
    fc = results.get("flatcake", {}).get("control")
    mc = results.get("mooncake", {}).get("control")
    lm = results.get("lmcache", {})
    lines = [
        f"| control plane, one {pages:,}-page request | ms |",
        "|---|---:|",
    ]
    if fc:
        for where, row in (("on another node", fc), ("on the client's machine", fc.get("local"))):
            if row is None:
                continue
            for cache in ("warm", "cold"):
                calls = f"{row[f'{cache}_calls']} calls, {row.get(f'{cache}_direct', 0)} direct"
                lines.append(
                    f"| FlatCake `locate(lease=True)`, owner {where}, {cache} location cache "
                    f"({calls}) | {row[f'{cache}_ms']:.2f} |"
                )
    if mc:
        total = mc["exist_ms"] + mc["lease_ms"]
        lines.append(f"| Mooncake `batch_is_exist` | {mc['exist_ms']:.2f} |")
        lines.append(f"| Mooncake `batch_get_replica_desc` (lease) | {mc['lease_ms']:.2f} |")
        lines.append(f"| Mooncake both | {total:.2f} |")
    for path, row in lm.get("restore_lookup", {}).items():
        lines.append(f"| LMCache `lookup` ({path} backend; no lease) | {row:.2f} |")
    return lines


def scale_table(results: dict[str, Any]) -> list[str]:
    fc = results.get("flatcake", {}).get("scale", {})
    mc = results.get("mooncake", {}).get("scale", {})
    if not fc and not mc:
        return []
    pages = results["config"]["scale_pages"]
    lines = [
        "| clients per node (total) | FlatCake restore GB/s (of 2 clients) | FlatCake put GB/s "
        "(share local; of 2 clients) | Mooncake restore GB/s | Mooncake put GB/s |",
        "|---|---:|---:|---:|---:|",
    ]
    base = fc.get(2) or fc.get("2")
    for k in sorted({*map(int, fc), *map(int, mc)}):
        f, m = fc.get(k) or fc.get(str(k)), mc.get(k) or mc.get(str(k))
        clients = (f or m)["clients"]
        restore_of, put_of = _of_two(f, base, "restore_gbps"), _of_two(f, base, "put_gbps")
        lines.append(
            f"| {k} ({clients}) | "
            + (
                f"{f['restore_gbps']:.2f}{restore_of and f' ({restore_of})'} | "
                f"{f['put_gbps']:.2f} ({f['put_local_share']:.2f} local{put_of and ', ' + put_of})"
                if f
                else "— | —"
            )
            + " | "
            + (f"{m['restore_gbps']:.2f} | {m['put_gbps']:.2f}" if m else "— | —")
            + " |"
        )
    lines.append("")
    lines.append(
        f"Each client restores one {pages}-page DRAM session (the same one) and puts its own "
        f"{pages}-page DRAM session, all at once: the clients of a round start together at a "
        "wall-clock gate, their bytes made before it and checked once every client is done; "
        "aggregate = all bytes / (last end - first start), median of rounds. In parentheses "
        "beside FlatCake's rates: the fraction of the 2-clients-per-node aggregate (target: "
        ">= 0.9 at 8)."
    )
    return lines


def _of_two(row: dict[str, Any] | None, base: dict[str, Any] | None, name: str) -> str:
    """``row``'s ``name`` as a fraction of the 2-clients-per-node row's, or nothing."""
    if not row or not base or not base[name]:
        return ""
    return f"{row[name] / base[name]:.2f}" if row is not base else ""


def markdown(results: dict[str, Any]) -> str:
    config, limits = results["config"], results["limits"]
    parts = [
        f"Command: `{config['command']}`",
        "",
        f"Workload: {config['pages']:,} pages x {config['layers']} layers x "
        f"{config['page_bytes'] // 1024} KiB = {config['bytes'] / 1e6:.0f} MB a request; "
        f"medians of {config['rounds']} rounds after a warm-up; GB/s = 1e9 bytes/s; in "
        "parentheses the fraction of the cell's physical limit (named in the last column). "
        f"Whole run {config['wall_seconds']:.0f} s; load average {config['load_before']} before, "
        f"{config['load_after']} after.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in config["versions"].items()) + ".",
        "",
        "**Restore** (every restore checked byte for byte):",
        "",
        *throughput_table(results, "restore"),
        "",
        "**Put** (FlatCake: until `put` returns, pages published; Mooncake SSD: until every key "
        "has a disk replica; LMCache: until `lookup` finds every token):",
        "",
        *throughput_table(results, "put"),
        "",
        *control_table(results),
        "",
        *scale_table(results),
        "",
        "Limits measured in this run (GB/s): "
        + ", ".join(f"{name} {value:.2f}" for name, value in limits.items())
        + ".",
    ]
    return "\n".join(parts) + "\n"


def write_section(path: str, text: str) -> None:
    """Replace what lies between the bench-peers markers of ``path`` (or append them)."""
    target = Path(path)
    old = target.read_text() if target.exists() else ""
    block = f"{START}\n{text}{END}"
    if START in old and END in old:
        head, rest = old.split(START, 1)
        _, tail = rest.split(END, 1)
        target.write_text(head + block + tail)
    else:
        target.write_text(old.rstrip("\n") + "\n\n" + block + "\n")
