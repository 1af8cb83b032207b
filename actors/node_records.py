"""What the coordinator knows of each storage node, and whether that node is up, silent or lost.

A node is *up* while its reports arrive (one within ``node_timeout_s``). It is *lost* when
Ray says the Ray node it runs on is dead (removed, or failed Ray's health checks): its
actor is pinned to that node with hard affinity, so Ray cannot restart it anywhere else, its
process and DRAM arena are gone, and the DRAM scopes of its last report are lost. Its SSD
scopes stay on its drives: a storage node started again on that host with the same root
(``flatcake-ray start``, which ``ray up`` runs on every joining node) asks for the lost
node's NodeID and gets it, and recovers them from the manifest. A node that stopped reporting
on a Ray node that Ray still calls alive is *silent* (hung, or cut off): no new scopes go
there either, and nothing is counted lost yet.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from flatcake_ray.actors.protocol import NodeUsage
from flatcake_ray.config import ServiceConfig
from flatcake_ray.errors import ServiceError

UP, SILENT, LOST = "up", "silent", "lost"
WATCH_EVERY_S = 1.0  # Ray's node table is read at most this often


@dataclass
class NodeRecord:
    node_id: int
    ray_node_id: str
    actor_name: str
    joined_at: float  # wall clock: the node's own start time, so a rebuild does not re-ramp it
    last_seen: float
    usage: NodeUsage | None = None
    placed: int = 0  # scopes placed here since this coordinator started
    credit: float = 0.0  # smooth weighted round-robin state
    lost_noted: bool = False  # its loss is logged and kept in the GCS (actors/lost.py)

    def state(self, now: float, config: ServiceConfig, ray_dead: bool) -> str:
        if ray_dead:
            return LOST
        return UP if now - self.last_seen < config.node_timeout_s else SILENT

    def row(self, now: float, config: ServiceConfig, ray_dead: bool = False) -> dict[str, Any]:
        usage = self.usage
        state = self.state(now, config, ray_dead)
        return {
            "node_id": self.node_id,
            "ray_node_id": self.ray_node_id,
            "actor_name": self.actor_name,
            "state": state,
            "alive": state == UP,
            "last_seen_s": round(now - self.last_seen, 3),
            "ramp": ramp(self, now, config),
            "placed": self.placed,
            "dram_capacity": usage.dram_capacity if usage else 0,
            "dram_used": usage.dram_used if usage else 0,
            "ssd_capacity": usage.ssd_capacity if usage else 0,
            "ssd_used": usage.ssd_used if usage else 0,
            "scopes": usage.scopes if usage else 0,
            "pages": usage.pages if usage else 0,
            **self.lost_dram(state),
        }

    def lost_dram(self, state: str) -> dict[str, int]:
        """The DRAM of the node's last report, counted lost once the node is lost."""
        usage = self.usage if state == LOST else None
        return {
            "lost_dram_scopes": usage.dram_scopes if usage else 0,
            "lost_dram_pages": usage.dram_pages if usage else 0,
            "lost_dram_bytes": usage.dram_used if usage else 0,
        }


def check_registration(
    ray_node_id: object, actor_name: object, wanted_node_id: object, started_at: object
) -> None:
    """A registration's fields, typed: a malformed one would poison placement for everyone."""
    if not isinstance(ray_node_id, str) or not isinstance(actor_name, str):
        raise ServiceError("a registration names its Ray node and its actor as str")
    if wanted_node_id is not None and (
        isinstance(wanted_node_id, bool) or not isinstance(wanted_node_id, int)
    ):
        raise ServiceError(f"a wanted NodeID is an int or None, not {wanted_node_id!r}")
    if isinstance(started_at, bool) or not isinstance(started_at, int | float):
        raise ServiceError(f"a start time is a number, not {type(started_at).__name__}")
    if started_at != started_at:  # NaN would make every ramp NaN
        raise ServiceError("a start time is a number, not NaN")


def ramp(record: NodeRecord, now: float, config: ServiceConfig) -> float:
    if config.ramp_seconds == 0:
        return 1.0
    grown = (now - record.joined_at) / config.ramp_seconds
    return min(1.0, config.ramp_floor + (1.0 - config.ramp_floor) * max(0.0, grown))


def ray_alive_nodes() -> frozenset[str]:
    """The Ray node ids Ray calls alive now (one read of its node table)."""
    import ray

    return frozenset(n["NodeID"] for n in ray.nodes() if n["Alive"])


class RayNodeWatch:
    """Which Ray nodes are dead, from Ray's node table, read at most every ``every_s``.

    A node Ray no longer lists at all is dead too (Ray forgets dead nodes after a while).
    ``alive_nodes`` is how the table is read: :func:`ray_alive_nodes` in the service."""

    def __init__(
        self,
        alive_nodes: Callable[[], Iterable[str]] = ray_alive_nodes,
        every_s: float = WATCH_EVERY_S,
    ) -> None:
        self._read = alive_nodes
        self._every_s = every_s
        self._alive: frozenset[str] = frozenset()
        self._read_at = float("-inf")

    def dead(self, ray_node_id: str, *, fresh: bool = False) -> bool:
        """``fresh``: read Ray's table now, whatever its age (registration: a node must
        not be refused its NodeID because the table is a second old)."""
        now = time.monotonic()
        if fresh or now - self._read_at >= self._every_s:
            self._alive = frozenset(self._read())
            self._read_at = now
        return ray_node_id not in self._alive
