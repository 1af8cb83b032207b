"""What a store or a client records, from what it already holds: once per request or report.

- :meth:`Metrics.restore_ended`: a restore's release (``Source.release``) hands over its
  :class:`ReadOutcome` (per-path tallies, bytes read and wanted per medium, commands, timings)
  and its lease parts (the medium of every page): lookups, hits by medium, bytes by medium and
  path, SSD commands, latency and queue wait. Never per page, and not on the request's
  path: the request queues what it holds (an append), folded into series in batches.
- :meth:`Metrics.probed`: an ``exists``/``probe`` call.
- :meth:`Metrics.put_committed`: a put's commit, on the node that wrote it.
- :meth:`Metrics.node_state`: a node's gauges and its reclamation and quarantine counters,
  refreshed whenever its stats are read (a storage node reads them for every capacity
  report, every ``report_interval_s``).

A storage node's store sets ``count_requests = False``: the requests it serves are counted by
the clients that made them (once, not once per node a lookup fans out to).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flatcake_ray.core.api import PutResult
from flatcake_ray.core.catalog import Scope
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.parts import LeasePart
from flatcake_ray.metrics.definitions import NO_NODE
from flatcake_ray.metrics.prometheus import Sample
from flatcake_ray.metrics.registry import Batch, Recorder, track
from flatcake_ray.restore.source import ReadOutcome

_DIFFED = {  # node counters: the store's running totals, exported as increments
    "reclaimed_scopes": "flatcake_reclaimed_scopes",
    "reclaimed_bytes": "flatcake_reclaimed_bytes",
    "quarantined_scopes": "flatcake_quarantined_scopes",
}


FOLD_EVERY = 64  # queued requests folded at once, at the latest

_MEDIUM_TAGS: dict[Medium | None, str] = {m: m.name.lower() for m in Medium}
_MEDIUM_TAGS[None] = "none"


def medium_tag(medium: Medium | None) -> str:
    return _MEDIUM_TAGS[medium]


@functools.cache
def path_medium(path: str) -> Medium | None:
    """The medium a read path serves, from its name (``transports/base.py``); None for the
    object-store fallback, which serves either."""
    if "dram" in path:
        return Medium.DRAM
    if "ssd" in path:
        return Medium.SSD
    return None


def by_medium_and_path(
    per_path: Mapping[str, int], per_medium: Mapping[Medium, int]
) -> dict[tuple[Medium, str], int]:
    """Split per-path totals by medium. A restore reaches each medium by one path, so the
    one path whose name names no medium (the fallback) carries what the named ones do not."""
    out: dict[tuple[Medium, str], int] = {}
    named: dict[Medium, int] = {}
    unnamed = [path for path in per_path if path_medium(path) is None]
    for path, amount in per_path.items():
        medium = path_medium(path)
        if medium is not None and amount:
            out[medium, path] = out.get((medium, path), 0) + amount
            named[medium] = named.get(medium, 0) + amount
    for medium, total in per_medium.items():
        rest = total - named.get(medium, 0)
        if rest > 0 and unnamed:
            out[medium, unnamed[0]] = out.get((medium, unnamed[0]), 0) + rest
    return out


def hits_by_medium(parts: Sequence[LeasePart], pages: int) -> dict[Medium, int]:
    """Pages of the verified prefix ``[0, pages)`` on each medium (one count per part)."""
    out: dict[Medium, int] = {}
    for part in parts:
        within = int(np.count_nonzero(part.dst_positions < pages))
        if within:
            out[part.medium] = out.get(part.medium, 0) + within
    return out


def restore_path(parts: Sequence[LeasePart], outcome: ReadOutcome) -> str:
    """The path that moved most bytes of the restore's slowest medium (its latency's path)."""
    slowest = Medium.SSD if any(p.medium is Medium.SSD for p in parts) else Medium.DRAM
    moved = {path: tally.bytes for path, tally in outcome.paths.items()}
    ours = {p: b for p, b in moved.items() if path_medium(p) in (slowest, None)} or moved
    return max(ours, key=lambda p: ours[p]) if ours else NO_NODE


class Metrics:
    """One store's or client's metrics: recorded in process, forwarded to Ray when it runs."""

    def __init__(self, *, node_id: int | None, page_tokens: int) -> None:
        self.recorder = Recorder()
        self.node_id = node_id  # the store's NodeID; None for a client
        self.count_requests = True
        self._page_tokens = page_tokens
        self._lock = threading.Lock()
        self._reported: dict[str, int] = dict.fromkeys(_DIFFED, 0)
        self._tenants: set[str] = set()  # tenants with use reported (a gone one reports 0)
        self.restarts = 0  # times this node's actor was restarted (its storage node sets it)
        self._requests: list[tuple[Any, tuple[Any, ...]]] = []  # queued, not yet folded
        self._fold_lock = threading.Lock()
        track(self)

    # ---- requests ------------------------------------------------------------------------
    # A request only queues what it already holds (one append under a lock); the breakdown
    # by medium and path is made by :meth:`fold`: every FOLD_EVERY requests, whenever the
    # figures are read (samples, snapshot), and every second by the Ray forwarder's thread.
    def restore_ended(
        self,
        parts: Sequence[LeasePart],
        outcome: ReadOutcome,
        pages: int,
        tenant: str,
        node_id: int | None = None,
    ) -> None:
        """A restore of ``tenant`` ended with ``pages`` verified (its release's answer);
        ``node_id``: the node that leased the parts (default: this store's). ``outcome`` is
        complete at its release and never changed after."""
        if self.count_requests:
            self._queue((self._restore, (parts, outcome, pages, tenant, node_id)))

    def probed(self, tenant: str, asked: int, found: int, node_id: int | None = None) -> None:
        """An ``exists``/``probe`` of ``asked`` keys found ``found`` consecutive pages."""
        if self.count_requests:
            self._queue((self._probe, (tenant, asked, found, node_id)))

    def _queue(self, request: tuple[Any, tuple[Any, ...]]) -> None:
        with self._lock:
            self._requests.append(request)
            full = len(self._requests) >= FOLD_EVERY
        if full:
            self.fold()

    def fold(self) -> None:
        """Turn the queued requests into series (one batch for all of them)."""
        with self._fold_lock:  # folds apply in the order their requests were queued
            with self._lock:
                requests, self._requests = self._requests, []
            if not requests:
                return
            batch = Batch()
            for record, args in requests:
                record(batch, *args)
            self.recorder.apply(batch)

    def _restore(
        self,
        batch: Batch,
        parts: Sequence[LeasePart],
        outcome: ReadOutcome,
        pages: int,
        tenant: str,
        node_id: int | None,
    ) -> None:
        node = node_id if node_id is not None else self.node_id
        req = (str(node) if parts and node is not None else NO_NODE, tenant)
        asked = outcome.requested or outcome.pages
        batch.inc("flatcake_lookups", req)
        batch.inc("flatcake_lookup_pages", req, asked)
        batch.inc("flatcake_lookup_tokens", req, asked * self._page_tokens)
        for medium, hit in hits_by_medium(parts, pages).items():
            batch.inc("flatcake_hit_pages", (*req, medium_tag(medium)), hit)
            batch.inc("flatcake_hit_tokens", (*req, medium_tag(medium)), hit * self._page_tokens)
        self._reads(batch, req, outcome)
        batch.inc("flatcake_read_failures", req, len(outcome.failures))
        if parts:
            path = restore_path(parts, outcome)
            batch.observe("flatcake_restore_seconds", (*req, path), outcome.seconds)
            batch.observe("flatcake_restore_queue_seconds", (*req, path), outcome.queued_s)

    def _probe(
        self, batch: Batch, tenant: str, asked: int, found: int, node_id: int | None
    ) -> None:
        node = node_id if node_id is not None else self.node_id
        req = (str(node) if found and node is not None else NO_NODE, tenant)
        batch.inc("flatcake_probes", req)
        batch.inc("flatcake_probe_pages", req, asked)
        batch.inc("flatcake_probe_hit_pages", req, found)

    def _reads(self, batch: Batch, req: tuple[str, str], outcome: ReadOutcome) -> None:
        paths = outcome.paths
        read = by_medium_and_path({p: t.bytes for p, t in paths.items()}, outcome.bytes_read)
        for (medium, path), nbytes in read.items():
            batch.inc("flatcake_read_bytes", (*req, medium_tag(medium), path), nbytes)
        for medium, nbytes in outcome.bytes_wanted.items():
            batch.inc("flatcake_delivered_bytes", (*req, medium_tag(medium)), nbytes)
        commands = by_medium_and_path(
            {p: t.io_commands for p, t in paths.items()}, outcome.commands
        )
        for (medium, path), count in commands.items():
            if medium is Medium.SSD:
                batch.inc("flatcake_ssd_read_commands", (*req, path), count)

    # ---- the node ------------------------------------------------------------------------
    def put_committed(
        self, tenant: str, page_all_layers: int, result: PutResult, path: str
    ) -> None:
        """A put of ``tenant`` (pages of ``page_all_layers`` bytes) committed on this node;
        ``path``: how its bytes reached the node."""
        tags = (str(self.node_id), tenant, medium_tag(result.medium), path)
        batch = Batch()
        batch.inc("flatcake_puts", tags)
        batch.inc("flatcake_written_pages", tags, result.pages_written)
        batch.inc("flatcake_written_bytes", tags, result.pages_written * page_all_layers)
        self.recorder.apply(batch)

    def node_state(self, stats: Mapping[str, Any], scopes: Sequence[Scope]) -> None:
        """Refresh the node's gauges from its ``stats`` and live ``scopes`` (the caller holds
        the store's lock, so both are one moment's)."""
        node = (str(self.node_id),)
        batch = Batch()
        per_medium = dict.fromkeys(Medium, 0)
        for scope in scopes:
            per_medium[scope.medium] += 1
        used = {Medium.DRAM: stats["dram_used"], Medium.SSD: stats["ssd_reserved"]}
        capacity = {Medium.DRAM: stats["dram_capacity"], Medium.SSD: stats["ssd_capacity"]}
        for medium in Medium:
            tags = (*node, medium_tag(medium))
            batch.set("flatcake_scopes", tags, per_medium[medium])
            batch.set("flatcake_media_used_bytes", tags, used[medium])
            batch.set("flatcake_media_capacity_bytes", tags, capacity[medium])
        batch.set("flatcake_pages", node, stats["pages_indexed"])
        batch.set("flatcake_leases", node, stats["leases_open"])
        batch.set("flatcake_index_bytes", node, stats["index_bytes"])
        batch.set("flatcake_pool_utilisation", node, stats["ssd_pool_utilisation"])
        batch.set("flatcake_ssd_prewrite_pending_bytes", node, stats["ssd_prewrite_pending"])
        batch.set("flatcake_ssd_prewrite_waited_seconds", node, stats["ssd_prewrite_waited_s"])
        batch.set("flatcake_node_up", node, 1)
        batch.set("flatcake_node_restarts", node, self.restarts)
        self._tenant_use(batch, node, stats.get("tenants", {}))
        with self._lock:
            for key, name in _DIFFED.items():
                batch.inc(name, node, stats[key] - self._reported[key])
                self._reported[key] = stats[key]
        self.recorder.apply(batch)

    def _tenant_use(
        self, batch: Batch, node: tuple[str], tenants: Mapping[str, Mapping[str, Any]]
    ) -> None:
        """Each tenant's bytes per medium; a tenant removed since the last report shows 0."""
        with self._lock:
            gone, self._tenants = self._tenants - set(tenants), set(tenants)
        for tenant in gone:
            for medium in Medium:
                batch.set("flatcake_tenant_used_bytes", (*node, tenant, medium_tag(medium)), 0)
        for tenant, row in tenants.items():
            for medium in Medium:
                nbytes = row[f"{medium_tag(medium)}_used"]
                batch.set("flatcake_tenant_used_bytes", (*node, tenant, medium_tag(medium)), nbytes)

    def restarted(self, restarts: int, lost_dram_scopes: int) -> None:
        """This node's actor started for the ``restarts``-th time since the operator started
        it, having lost ``lost_dram_scopes`` DRAM scopes (``actors/supervision.py``)."""
        self.restarts = restarts
        batch = Batch()
        batch.inc(
            "flatcake_lost_scopes", (str(self.node_id), medium_tag(Medium.DRAM)), lost_dram_scopes
        )
        self.recorder.apply(batch)

    # ---- reading -------------------------------------------------------------------------
    def samples(self) -> list[Sample]:
        self.fold()
        return self.recorder.samples()

    def snapshot(self) -> list[dict[str, Any]]:
        self.fold()
        return self.recorder.snapshot()
