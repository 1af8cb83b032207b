"""CapacityCoordinator: the cluster's one control-plane actor (named, detached).

It gives each storage node a 12-bit NodeID, tracks capacity and use per node and medium from
the nodes' periodic reports, and places each new session scope on a node. It is never on the
read path: clients find pages by asking storage nodes (see ``flatcake_ray/client.py``), so a
dead or restarting coordinator delays only the first put of new sessions.

Placement is smooth weighted round-robin over the live nodes, weight = free bytes (DRAM + SSD)
x ramp, where ramp grows linearly from ``ramp_floor`` to 1 over ``ramp_seconds`` after a node
joins. Proportional shares (not "pick the emptiest") keep one empty node from taking every new
scope between two reports, and the ramp keeps a node that just joined from being flooded.

State is soft: on (re)start the coordinator asks every storage node it finds by name for its
NodeID, start time, usage and sessions, and carries on from that. Nodes keep their NodeIDs.
This is a plain class; ``flatcake_ray/service.py`` wraps it with ``ray.remote``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from flatcake_ray.actors.protocol import NO_LOCAL_NODE, NODE_NAME_PREFIX, NodeUsage
from flatcake_ray.config import ServiceConfig
from flatcake_ray.core.gva import MAX_NODE_ID
from flatcake_ray.errors import ServiceError

log = logging.getLogger(__name__)
MAX_SESSIONS = 1 << 20  # session -> node entries kept (oldest forgotten first)
REBUILD_TIMEOUT_S = 5.0


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

    def row(self, now: float, config: ServiceConfig) -> dict[str, Any]:
        usage = self.usage
        return {
            "node_id": self.node_id,
            "ray_node_id": self.ray_node_id,
            "actor_name": self.actor_name,
            "alive": now - self.last_seen < config.node_timeout_s,
            "ramp": ramp(self, now, config),
            "placed": self.placed,
            "dram_capacity": usage.dram_capacity if usage else 0,
            "dram_used": usage.dram_used if usage else 0,
            "ssd_capacity": usage.ssd_capacity if usage else 0,
            "ssd_used": usage.ssd_used if usage else 0,
            "scopes": usage.scopes if usage else 0,
            "pages": usage.pages if usage else 0,
        }


def ramp(record: NodeRecord, now: float, config: ServiceConfig) -> float:
    if config.ramp_seconds == 0:
        return 1.0
    grown = (now - record.joined_at) / config.ramp_seconds
    return min(1.0, config.ramp_floor + (1.0 - config.ramp_floor) * max(0.0, grown))


class CapacityCoordinator:
    def __init__(self, config: ServiceConfig, *, rebuild: bool = True) -> None:
        self.config = config
        self.nodes: dict[int, NodeRecord] = {}
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.started_at = time.time()
        self.counters = {"registrations": 0, "placements": 0, "rebuilt_nodes": 0, "reports": 0}
        if rebuild:
            self._rebuild()

    # ---- membership ------------------------------------------------------------------------
    def register(
        self, ray_node_id: str, actor_name: str, wanted_node_id: int | None, started_at: float
    ) -> int:
        """The NodeID of this storage node: its old one if free, else the lowest free one."""
        now = time.time()
        for record in self.nodes.values():
            if record.ray_node_id == ray_node_id:  # a repeated registration: same answer
                record.last_seen = now
                return record.node_id
        node_id = self._free_node_id(wanted_node_id)
        self.nodes[node_id] = NodeRecord(node_id, ray_node_id, actor_name, started_at, now)
        self.counters["registrations"] += 1
        log.info("storage node %s registered as NodeID %d", ray_node_id[:12], node_id)
        return node_id

    def _free_node_id(self, wanted: int | None) -> int:
        if wanted is not None and NO_LOCAL_NODE < wanted <= MAX_NODE_ID:
            holder = self.nodes.get(wanted)
            if holder is None or not self._alive(holder, time.time()):
                self.nodes.pop(wanted, None)
                return wanted
        for node_id in range(NO_LOCAL_NODE + 1, MAX_NODE_ID + 1):
            if node_id not in self.nodes:
                return node_id
        raise ServiceError(f"all {MAX_NODE_ID} NodeIDs are in use")

    def report(self, node_id: int, ray_node_id: str, usage: NodeUsage) -> bool:
        """A node's periodic usage report; False tells it to register again (we forgot it)."""
        record = self.nodes.get(node_id)
        if record is None or record.ray_node_id != ray_node_id:
            return False
        record.usage = usage
        record.last_seen = time.time()
        self.counters["reports"] += 1
        return True

    def forget(self, node_id: int) -> None:
        self.nodes.pop(node_id, None)

    def _alive(self, record: NodeRecord, now: float) -> bool:
        return now - record.last_seen < self.config.node_timeout_s

    # ---- placement -------------------------------------------------------------------------
    def place_scope(self, session_id: str | None = None) -> int:
        """The NodeID that holds (or will hold) this session's scopes."""
        now = time.time()
        if session_id is not None:
            known = self.sessions.get(session_id)
            if known is not None and known in self.nodes and self._alive(self.nodes[known], now):
                self.sessions.move_to_end(session_id)
                return known
        node_id = self._choose(now)
        if session_id is not None:
            self.sessions[session_id] = node_id
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        self.counters["placements"] += 1
        return node_id

    def _choose(self, now: float) -> int:
        live = [r for r in self.nodes.values() if self._alive(r, now)]
        if not live:
            raise ServiceError("no live storage node to place a scope on")
        weights = {r.node_id: self._weight(r, now) for r in live}
        total = sum(weights.values())
        for record in live:
            record.credit += weights[record.node_id]
        chosen = max(live, key=lambda r: (r.credit, -r.node_id))
        chosen.credit -= total
        chosen.placed += 1
        return chosen.node_id

    def _weight(self, record: NodeRecord, now: float) -> float:
        # A node that has not reported yet counts as one byte free: it gets a scope only when
        # nothing else has room, and its first report gives it its real share.
        free = record.usage.free_bytes if record.usage is not None else 1
        return max(1.0, float(free)) * ramp(record, now, self.config)

    # ---- views -----------------------------------------------------------------------------
    def nodes_table(self) -> list[dict[str, Any]]:
        now = time.time()
        return [self.nodes[n].row(now, self.config) for n in sorted(self.nodes)]

    def info(self) -> dict[str, Any]:
        return {
            "started_at": self.started_at,
            "nodes": len(self.nodes),
            "sessions": len(self.sessions),
            **self.counters,
        }

    def ping(self) -> str:
        return "ok"

    def service_config(self) -> dict[str, Any]:
        """The config this service was started with (``start`` checks its geometry)."""
        return self.config.to_dict()

    # ---- recovery --------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Adopt every storage node that answers by name: its NodeID, usage and sessions."""
        import ray

        names = [
            entry["name"]
            for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry["namespace"] == self.config.namespace
            and entry["name"].startswith(NODE_NAME_PREFIX)
        ]
        refs = {}
        for name in names:
            try:
                handle = ray.get_actor(name, namespace=self.config.namespace)
            except ValueError:  # gone between the listing and now
                continue
            refs[name] = handle.coordinator_view.remote()
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=REBUILD_TIMEOUT_S)
        for name, ref in refs.items():
            if ref in ready:
                self._adopt_view(name, ref)

    def _adopt_view(self, name: str, ref: Any) -> None:
        import ray
        from ray.exceptions import RayError

        try:
            view = ray.get(ref)
        except RayError as exc:  # that node died or is still starting; it re-registers
            log.warning("storage node %s did not answer the rebuild: %s", name, exc)
            return
        node_id = int(view["node_id"])
        if node_id in self.nodes:
            log.warning("NodeID %d claimed twice; %s must register again", node_id, name)
            return
        record = NodeRecord(node_id, view["ray_node_id"], name, view["started_at"], time.time())
        record.usage = view["usage"]
        self.nodes[node_id] = record
        for session_id in view["sessions"]:
            self.sessions[session_id] = node_id
        self.counters["rebuilt_nodes"] += 1
