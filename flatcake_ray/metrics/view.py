"""The figures ``flatcake-ray status`` shows, per node and per tenant, from metric samples.

The samples are a scrape of every Ray node's metrics agent (so clients' restores count, not
only what the storage nodes see) or a store's own ``stats()["metrics"]``. Counters and
histograms are summed over the processes that exported them; a gauge takes the largest value
any process exported for the same tags (a restarted node's old worker lingers in the agent
until its gauges expire). Latency quantiles are interpolated within buckets, as Prometheus's
``histogram_quantile`` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from flatcake_ray.metrics.definitions import (
    BY_NAME,
    MEDIUM,
    NODE_ID,
    PATH,
    RAY_PREFIX,
    TENANT,
    Kind,
)
from flatcake_ray.metrics.prometheus import Sample, ray_endpoints, scrape_all

OURS = frozenset({NODE_ID, TENANT, MEDIUM, PATH, "le"})
MEDIA = ("dram", "ssd")
ALL = "all"
PREFIX = RAY_PREFIX + "flatcake_"


def _series(name: str) -> str:
    return BY_NAME[name].exported


def _ours(sample: Sample) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in sample.labels.items() if k in OURS))


def collapse(samples: Iterable[Sample]) -> list[Sample]:
    """One sample per series and FlatCake tags: Ray's per-process labels summed away (max for
    gauges)."""
    gauges = {m.exported for m in BY_NAME.values() if m.kind is Kind.GAUGE}
    merged: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in samples:
        key = (sample.name, _ours(sample))
        if sample.name in gauges:
            merged[key] = max(merged.get(key, -math.inf), sample.value)
        else:
            merged[key] = merged.get(key, 0.0) + sample.value
    return [Sample(name, dict(labels), value) for (name, labels), value in merged.items()]


def _total(samples: list[Sample], series: str, where: Mapping[str, str], **more: str) -> float:
    want = {**where, **more}
    return sum(
        s.value
        for s in samples
        if s.name == series and all(s.labels.get(k) == v for k, v in want.items())
    )


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The ``q`` quantile of cumulative ``buckets`` (upper bound -> count), or None if empty."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite boundary: the best Prometheus can say
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _latency(samples: list[Sample], where: Mapping[str, str]) -> dict[str, Any]:
    series = _series("flatcake_restore_seconds")
    buckets: dict[float, float] = {}
    for s in samples:
        if s.name == series + "_bucket" and all(s.labels.get(k) == v for k, v in where.items()):
            bound = float(s.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + s.value
    p50, p99 = quantile(0.5, buckets), quantile(0.99, buckets)
    return {
        "restores": int(_total(samples, series + "_count", where)),
        "restore_p50_ms": None if p50 is None else p50 * 1e3,
        "restore_p99_ms": None if p99 is None else p99 * 1e3,
    }


def figures(samples: list[Sample], where: Mapping[str, str], used: str) -> dict[str, Any]:
    """One row: lookups, hit rates by medium, probes, latency, use, reclamation."""
    lookup_pages = _total(samples, _series("flatcake_lookup_pages"), where)
    hits = {m: _total(samples, _series("flatcake_hit_pages"), where, medium=m) for m in MEDIA}
    probe_pages = _total(samples, _series("flatcake_probe_pages"), where)
    probe_hits = _total(samples, _series("flatcake_probe_hit_pages"), where)
    return {
        "lookups": int(_total(samples, _series("flatcake_lookups"), where)),
        "lookup_pages": int(lookup_pages),
        "hit_pages": {m: int(n) for m, n in hits.items()},
        "hit_rate": {m: (n / lookup_pages if lookup_pages else None) for m, n in hits.items()},
        "probes": int(_total(samples, _series("flatcake_probes"), where)),
        "probe_hit_rate": probe_hits / probe_pages if probe_pages else None,
        **_latency(samples, where),
        "used_bytes": {m: int(_total(samples, _series(used), where, medium=m)) for m in MEDIA},
        "written_bytes": {
            m: int(_total(samples, _series("flatcake_written_bytes"), where, medium=m))
            for m in MEDIA
        },
    }


def _node_only(samples: list[Sample], node: str) -> dict[str, Any]:
    where = {NODE_ID: node}
    restarts = [
        s.value
        for s in samples
        if s.name == _series("flatcake_node_restarts") and s.labels.get(NODE_ID) == node
    ]
    return {
        "restarts": int(sum(restarts)) if restarts else None,  # None: not a storage node
        "quarantined_scopes": int(_total(samples, _series("flatcake_quarantined_scopes"), where)),
        "reclaimed_scopes": int(_total(samples, _series("flatcake_reclaimed_scopes"), where)),
        "lost_dram_scopes": int(
            _total(samples, _series("flatcake_lost_scopes"), where, medium="dram")
        ),
        "ssd_prewrite_pending_bytes": int(
            _total(samples, _series("flatcake_ssd_prewrite_pending_bytes"), where)
        ),
        "ssd_prewrite_waited_s": _total(
            samples, _series("flatcake_ssd_prewrite_waited_seconds"), where
        ),
    }


def status_view(samples: Iterable[Sample]) -> dict[str, Any]:
    """Rows per node (``none``: requests no node held) and per tenant on each node, plus
    each tenant across all nodes (``node_id`` ``all``)."""
    flat = collapse(s for s in samples if s.name.startswith(PREFIX))
    nodes = sorted({s.labels[NODE_ID] for s in flat if NODE_ID in s.labels}, key=_node_order)
    tenants = sorted({s.labels[TENANT] for s in flat if TENANT in s.labels})
    node_rows = [
        {
            NODE_ID: n,
            **figures(flat, {NODE_ID: n}, "flatcake_media_used_bytes"),
            **_node_only(flat, n),
        }
        for n in nodes
    ]
    tenant_rows = []
    for tenant in tenants:
        for node in [*nodes, ALL]:
            where = {TENANT: tenant} if node == ALL else {TENANT: tenant, NODE_ID: node}
            row = figures(flat, where, "flatcake_tenant_used_bytes")
            if node == ALL or row["lookups"] or row["probes"] or any(row["used_bytes"].values()):
                tenant_rows.append({TENANT: tenant, NODE_ID: node, **row})
    return {"nodes": node_rows, "tenants": tenant_rows}


def _node_order(node: str) -> tuple[int, str]:
    return (0, f"{int(node):08d}") if node.isdigit() else (1, node)


def cluster_status(timeout_s: float = 3.0) -> dict[str, Any]:
    """Scrape every Ray node's metrics agent (Ray initialized) and build :func:`status_view`."""
    scraped = scrape_all(ray_endpoints(), timeout_s, PREFIX)
    return {
        **status_view(scraped.samples),
        "endpoints": scraped.endpoints,
        "errors": scraped.errors,
    }


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f}"


def format_view(view: Mapping[str, Any]) -> str:
    """Two plain-text tables: per node, then per tenant on each node."""
    head = (
        f"{'node':>5} {'dram MiB':>9} {'ssd MiB':>9} {'lookups':>8} {'hit dram':>9} "
        f"{'hit ssd':>8} {'p50 ms':>8} {'p99 ms':>8} {'restarts':>8} {'lost':>5} {'quarant.':>8}"
    )
    lines = ["metrics per node (node none: requests no node held)", head]
    for r in view["nodes"]:
        restarts = "-" if r["restarts"] is None else str(r["restarts"])
        lines.append(
            f"{r[NODE_ID]:>5} {_mib(r['used_bytes']['dram']):>9} "
            f"{_mib(r['used_bytes']['ssd']):>9} {r['lookups']:>8} "
            f"{_pct(r['hit_rate']['dram']):>9} {_pct(r['hit_rate']['ssd']):>8} "
            f"{_ms(r['restore_p50_ms']):>8} {_ms(r['restore_p99_ms']):>8} {restarts:>8} "
            f"{r['lost_dram_scopes']:>5} {r['quarantined_scopes']:>8}"
        )
    lines.append(
        "restarts: Ray restarted the node's actor; lost: DRAM scopes those restarts lost "
        "(SSD scopes come back)"
    )
    for r in view["nodes"]:
        if r["ssd_prewrite_pending_bytes"]:
            lines.append(
                f"node {r[NODE_ID]}: {_mib(r['ssd_prewrite_pending_bytes'])} MiB of its SSD pool "
                "still to prewrite (its first SSD puts are slower until then; it has waited "
                f"{r['ssd_prewrite_waited_s']:.0f} s for an idle drive, live I/O first)"
            )
    lines.append("metrics per tenant (node all: every node)")
    lines.append(
        f"{'tenant':<16} {'node':>5} {'dram MiB':>9} {'ssd MiB':>9} {'lookups':>8} "
        f"{'hit dram':>9} {'hit ssd':>8} {'p50 ms':>8} {'p99 ms':>8}"
    )
    for r in view["tenants"]:
        lines.append(
            f"{r[TENANT][:16]:<16} {r[NODE_ID]:>5} {_mib(r['used_bytes']['dram']):>9} "
            f"{_mib(r['used_bytes']['ssd']):>9} {r['lookups']:>8} "
            f"{_pct(r['hit_rate']['dram']):>9} {_pct(r['hit_rate']['ssd']):>8} "
            f"{_ms(r['restore_p50_ms']):>8} {_ms(r['restore_p99_ms']):>8}"
        )
    for error in view.get("errors", ()):
        lines.append(f"metrics endpoint not read: {error}")
    return "\n".join(lines)
