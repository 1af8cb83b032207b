"""The vLLM connector's figures in vLLM's own metrics: ``KVConnectorStats`` and Prometheus.

vLLM asks each worker's connector for the stats of the step it just ran
(``get_kv_connector_stats``), sums the workers' (``aggregate``), adds the scheduler side's,
ships the payload (``to_dict``) to its front end and there hands it to the Prometheus logger
(:class:`FlatCakePromMetrics`, built by ``build_prom_metrics``) and to the periodic log line
(``reduce``). So a step's stats are a handful of counters: the connector counts as it works
(``WorkerSide.counters``, ``SchedulerSide.counters``), and :class:`Interval` turns those running
totals into what moved since the last step, without touching the hot path.

The series (``model_name`` and ``engine`` labels, as vLLM's own; under Ray Serve LLM Ray's
metrics agent exports them as ``ray_vllm_flatcake_*``):

========================================  =================================================
``vllm:flatcake_loads_total``             loads started (one per request's stored prefix)
``vllm:flatcake_load_blocks_total``       vLLM blocks restored from FlatCake
``vllm:flatcake_load_bytes_total``        bytes restored (every layer of those blocks)
``vllm:flatcake_load_failed_blocks_total`` blocks FlatCake could not deliver (recomputed)
``vllm:flatcake_save_blocks_total``       vLLM blocks saved (committed) to FlatCake
``vllm:flatcake_save_bytes_total``        bytes saved
``vllm:flatcake_save_failures_total``     saves given up (the pages become a future miss)
``vllm:flatcake_lookups_total``           prefix lookups by the scheduler
``vllm:flatcake_hit_blocks_total``        blocks those lookups found and vLLM took
``vllm:flatcake_held_lookups_total``      lookups answered "later": an older request brings
                                          the SSD blocks into HBM (shared-prefix hold)
``vllm:flatcake_announced_blocks_total``  blocks announced in BlockStored KV events
``vllm:flatcake_withdrawn_blocks_total``  blocks withdrawn in BlockRemoved KV events
========================================  =================================================

Workers' figures are summed over the engine's workers: under tensor parallelism each rank
moves its own shard, so blocks count once per rank and bytes are the bytes really moved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from flatcake_ray.errors import ConfigError

__all__ = [
    "FIELDS",
    "FlatCakeConnectorStats",
    "FlatCakePromMetrics",
    "Interval",
    "metric_name",
    "scheduler_totals",
    "worker_totals",
]

FIELDS: dict[str, str] = {
    "loads": "Loads of a stored prefix started by FlatCake's vLLM connector.",
    "load_blocks": "vLLM blocks restored from FlatCake.",
    "load_bytes": "Bytes restored from FlatCake into vLLM's KV cache.",
    "load_failed_blocks": "Blocks FlatCake could not deliver (vLLM recomputes them).",
    "save_blocks": "vLLM blocks saved to FlatCake.",
    "save_bytes": "Bytes saved to FlatCake.",
    "save_failures": "Saves to FlatCake given up (the pages become a future miss).",
    "lookups": "Prefix lookups in FlatCake by vLLM's scheduler.",
    "hit_blocks": "Blocks found in FlatCake that vLLM took.",
    "held_lookups": "Lookups held until an older request has brought the SSD blocks into HBM.",
    "announced_blocks": "Blocks announced in BlockStored KV events (saved to FlatCake).",
    "withdrawn_blocks": "Blocks withdrawn in BlockRemoved KV events (gone from FlatCake).",
}


def metric_name(field: str) -> str:
    return f"vllm:flatcake_{field}_total"


def _zeros() -> dict[str, int]:
    return dict.fromkeys(FIELDS, 0)


@dataclass
class FlatCakeConnectorStats(KVConnectorStats):
    """What moved in one interval: counters only, each a sum over steps and workers."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        given = dict(self.data)
        unknown = sorted(set(given) - set(FIELDS))
        if unknown:  # a worker and a front end of different FlatCake versions
            raise ConfigError(f"FlatCake's connector stats have no fields {unknown}")
        self.data = {**_zeros(), **{name: int(value) for name, value in given.items()}}

    def reset(self) -> None:
        self.data = _zeros()

    def aggregate(self, other: KVConnectorStats) -> FlatCakeConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + int(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: value for name, value in self.data.items() if value}

    def is_empty(self) -> bool:
        return not any(self.data.values())


def worker_totals(counters: Mapping[str, int], block_bytes: int) -> dict[str, int]:
    """The stats fields of a worker's running counters (``WorkerSide.counters``); a block is
    ``block_bytes`` (every layer of one vLLM block)."""
    return {
        "loads": counters["pipelined_loads"],
        "load_blocks": counters["loaded_pages"],
        "load_bytes": counters["loaded_pages"] * block_bytes,
        "load_failed_blocks": counters["failed_pages"],
        "save_blocks": counters["saved_pages"],
        "save_bytes": counters["saved_pages"] * block_bytes,
        "save_failures": counters["failed_saves"],
    }


def scheduler_totals(
    counters: Mapping[str, int], event_blocks: Mapping[str, int]
) -> dict[str, int]:
    """The stats fields of the scheduler side's counters and its KV events' block counts."""
    names = ("lookups", "hit_blocks", "held_lookups")
    return {**{name: counters[name] for name in names}, **event_blocks}


class Interval:
    """Running totals in, what they gained since the last call out (a stats object, or None
    when nothing moved). Totals only grow, so each is read once, without a lock."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def take(self, totals: Mapping[str, int]) -> FlatCakeConnectorStats | None:
        gained = {}
        for name, total in totals.items():
            gained[name] = total - self._seen.get(name, 0)
            self._seen[name] = total
        stats = FlatCakeConnectorStats(data={k: v for k, v in gained.items() if v})
        return None if stats.is_empty() else stats


class FlatCakePromMetrics(KVConnectorPromMetrics):
    """One counter per field, a child per engine; vLLM passes its metric classes (prometheus
    or Ray's wrappers), so the same code serves ``vllm serve`` and Ray Serve LLM."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter_cls = metric_types[Counter]
        self._counters: dict[str, dict[int, Any]] = {}
        for name, meaning in FIELDS.items():
            counter = counter_cls(
                name=metric_name(name), documentation=meaning, labelnames=labelnames
            )
            self._counters[name] = {
                engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in FlatCakeConnectorStats(data=transfer_stats_data).data.items():
            if value:
                self._counters[name][engine_idx].inc(value)
