"""Every metric FlatCake exports, in one table: name, kind, tags, boundaries, meaning.

Names are the ones given to ``ray.util.metrics``. Ray's metrics agent (OpenTelemetry's
Prometheus exporter, Ray's default since 2.4x) publishes each under the ``ray_`` namespace;
a counter gets ``_total`` appended (unless its name already ends so), a histogram becomes
``_bucket`` (with ``le``), ``_sum`` and ``_count`` series, a gauge keeps its name:
:meth:`MetricDef.series` applies exactly that, and the dashboard test checks the dashboard's
queries against it. Ray adds its own labels too (``SessionName``, ``WorkerId``,
``NodeAddress``, ``Component``, ...): queries aggregate them away.

Tags: ``node_id`` is FlatCake's NodeID of the storage node that held the pages (``none`` for a
request no node held any page of), ``tenant`` the tenant that made the request or
owns the pages (``flatcake-ray tenant``; ``default`` for the open default tenant),
``medium`` ``dram`` or ``ssd``, ``path`` the data path that moved the bytes (the transport
names of ``transports/base.py`` for reads; for a put, where its bytes went: ``in-process``
(an in-process store), or the memory a storage node handed out (``actors/protocol.py``
``PutMemory``): ``arena`` (a DRAM put, in place), ``landing`` (an SSD put) or ``inline``
(LAST RESORT, in the calls)).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

RAY_PREFIX = "ray_"
NODE_ID, TENANT, MEDIUM, PATH = "node_id", "tenant", "medium", "path"
NO_NODE = "none"  # node_id of a request that no storage node held any page of

# Seconds: 100 us (a small DRAM restore on one box) to 10 s (a GB-sized SSD context).
LATENCY_BOUNDARIES = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Kind(Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricDef:
    name: str  # as given to ray.util.metrics
    kind: Kind
    tags: tuple[str, ...]
    description: str
    boundaries: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        """The Prometheus name of the metric family (counters with ``_total``)."""
        base = RAY_PREFIX + self.name
        if self.kind is Kind.COUNTER and not base.endswith("_total"):
            return base + "_total"
        return base

    def series(self) -> tuple[str, ...]:
        """Every series name this metric appears under in a scrape."""
        if self.kind is Kind.HISTOGRAM:
            return tuple(self.exported + s for s in ("_bucket", "_sum", "_count"))
        return (self.exported,)


_REQ = (NODE_ID, TENANT)
_C, _G, _H = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM

METRICS: tuple[MetricDef, ...] = (
    # ---- requests: counted once per call, in the process that made it --------------------
    MetricDef("flatcake_lookups", _C, _REQ, "restore requests (one lease asked), hit or miss"),
    MetricDef("flatcake_lookup_pages", _C, _REQ, "pages the restore requests asked for"),
    MetricDef("flatcake_lookup_tokens", _C, _REQ, "tokens of those pages (pages x page_tokens)"),
    MetricDef("flatcake_hit_pages", _C, (*_REQ, MEDIUM), "pages restored, verified, by medium"),
    MetricDef("flatcake_hit_tokens", _C, (*_REQ, MEDIUM), "tokens of the pages restored"),
    MetricDef("flatcake_probes", _C, _REQ, "exists/probe calls (the scheduler's lookups)"),
    MetricDef("flatcake_probe_pages", _C, _REQ, "pages the probes asked about"),
    MetricDef("flatcake_probe_hit_pages", _C, _REQ, "consecutive pages the probes found"),
    MetricDef(
        "flatcake_read_bytes",
        _C,
        (*_REQ, MEDIUM, PATH),
        "bytes restores read, alignment and bridged gaps included (amplification's numerator)",
    ),
    MetricDef(
        "flatcake_delivered_bytes",
        _C,
        (*_REQ, MEDIUM),
        "page bytes restores delivered (amplification's denominator)",
    ),
    MetricDef("flatcake_ssd_read_commands", _C, (*_REQ, PATH), "SSD read commands of restores"),
    MetricDef("flatcake_read_failures", _C, _REQ, "restore chunks lost (their pages missed)"),
    MetricDef(
        "flatcake_restore_seconds",
        _H,
        (*_REQ, PATH),
        "a restore from submit to its last layer in place (path: its slowest medium's)",
        LATENCY_BOUNDARIES,
    ),
    MetricDef(
        "flatcake_restore_queue_seconds",
        _H,
        (*_REQ, PATH),
        "a restore's wait for a staging window (FC-MAS queue) after its lease",
        LATENCY_BOUNDARIES,
    ),
    # ---- puts: counted by the node that wrote them -----------------------------------------
    MetricDef("flatcake_puts", _C, (*_REQ, MEDIUM, PATH), "puts committed"),
    MetricDef("flatcake_written_pages", _C, (*_REQ, MEDIUM, PATH), "new pages puts wrote"),
    MetricDef("flatcake_written_bytes", _C, (*_REQ, MEDIUM, PATH), "page bytes puts wrote"),
    # ---- node state: refreshed with each of the node's capacity reports --------------------
    MetricDef("flatcake_scopes", _G, (NODE_ID, MEDIUM), "live scopes"),
    MetricDef("flatcake_pages", _G, (NODE_ID,), "pages indexed"),
    MetricDef("flatcake_leases", _G, (NODE_ID,), "leases held open by readers"),
    MetricDef("flatcake_index_bytes", _G, (NODE_ID,), "index memory, key copies included"),
    MetricDef("flatcake_media_used_bytes", _G, (NODE_ID, MEDIUM), "arena / SSD pool taken"),
    MetricDef("flatcake_media_capacity_bytes", _G, (NODE_ID, MEDIUM), "arena / SSD pool size"),
    MetricDef(
        "flatcake_pool_utilisation", _G, (NODE_ID,), "SSD bytes used / bytes reserved by scopes"
    ),
    MetricDef(
        "flatcake_ssd_prewrite_pending_bytes",
        _G,
        (NODE_ID,),
        "never-written SSD pool bytes the prewrite has still to write (ssd_prewrite)",
    ),
    MetricDef(
        "flatcake_ssd_prewrite_waited_seconds",
        _G,
        (NODE_ID,),
        "seconds the prewrite has waited for an idle drive, live I/O first (ssd_prewrite_paced)",
    ),
    MetricDef(
        "flatcake_tenant_used_bytes",
        _G,
        (NODE_ID, TENANT, MEDIUM),
        "bytes charged to each tenant per medium (its quota's count)",
    ),
    MetricDef("flatcake_reclaimed_scopes", _C, (NODE_ID,), "scopes reclaimed (freed whole)"),
    MetricDef("flatcake_reclaimed_bytes", _C, (NODE_ID,), "bytes reclaimed scopes gave back"),
    MetricDef("flatcake_quarantined_scopes", _C, (NODE_ID,), "scopes quarantined (bad checksum)"),
    MetricDef("flatcake_node_up", _G, (NODE_ID,), "1 while the storage node reports"),
    MetricDef(
        "flatcake_lost_scopes",
        _C,
        (NODE_ID, MEDIUM),
        "scopes a node's death lost (its DRAM scopes; SSD scopes are recovered)",
    ),
    MetricDef("flatcake_node_restarts", _G, (NODE_ID,), "times Ray restarted the node's actor"),
)

BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}


def exported_series() -> frozenset[str]:
    """Every Prometheus series name the service exports."""
    return frozenset(name for m in METRICS for name in m.series())
