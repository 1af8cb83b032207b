"""What one restore through the Ray client did: pages, paths, calls and times."""

from __future__ import annotations

from dataclasses import dataclass, field

from flatcake_ray.restore.source import PathTally


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
