"""What one restore through the Ray client did (pages, paths, calls and times), and what a
client counts over all of them (``FlatCakeClient.stats``: "client" and "paths")."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from flatcake_ray.restore.source import PathTally, ReadOutcome

_COUNTERS = ("puts", "gets", "exists", "hit_pages", "miss_pages", "actor_calls")
_FAILURES = ("lease_expired", "read_failures", "puts_object_store_fallback")


@dataclass
class RestoreReport:
    """One restore: pages restored, which path served them, and what it cost."""

    requested: int
    pages: int = 0
    node_id: int | None = None  # the node whose lease served the request
    paths: dict[str, PathTally] = field(default_factory=dict)
    actor_calls: int = 0  # calls to storage nodes, over Ray or direct
    direct_calls: int = 0  # those of them over a node's call channel (client/direct.py)
    nodes_asked: int = 0
    control_seconds: float = 0.0  # lookups and leases
    data_seconds: float = 0.0  # transports
    lease_expired: bool = False
    failures: list[str] = field(default_factory=list)

    def tally(self, path: str) -> PathTally:
        return self.paths.setdefault(path, PathTally())


class ClientTally:
    """A client's counters and per-path tallies; any thread may count."""

    def __init__(self) -> None:
        self.counters = dict.fromkeys((*_COUNTERS, *_FAILURES), 0)
        self.paths: dict[str, PathTally] = {}
        self._lock = threading.Lock()

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self.counters[name] += delta

    def restore_ended(self, report: RestoreReport, outcome: ReadOutcome, pages: int) -> None:
        """A restore's lease went back: finish its ``report`` from ``outcome``, count it."""
        report.pages = pages
        report.paths = outcome.paths
        report.failures = outcome.failures
        report.actor_calls += outcome.actor_calls
        report.data_seconds = sum(tally.seconds for tally in outcome.paths.values())
        with self._lock:
            self.counters["gets"] += 1
            self.counters["hit_pages"] += pages
            self.counters["miss_pages"] += report.requested - pages
            self.counters["actor_calls"] += report.actor_calls
            self.counters["lease_expired"] += int(report.lease_expired)
            self.counters["read_failures"] += len(report.failures)
            for path, tally in report.paths.items():
                self.paths.setdefault(path, PathTally()).merge(tally)

    def snapshot(self) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
        """(counters, each path's tally as a dict), copied."""
        with self._lock:
            return dict(self.counters), {p: vars(t).copy() for p, t in self.paths.items()}
