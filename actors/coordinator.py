"""CapacityCoordinator: the cluster's one control-plane actor (named, detached).

It gives each storage node a 12-bit NodeID, tracks capacity and use per node and medium from
the nodes' periodic reports, and places each new session scope on a node. It is never on the
read path: clients find pages by asking storage nodes (see ``flatcake_ray/client.py``), so a
dead or restarting coordinator delays only the first put of new sessions.

Placement is smooth weighted round-robin over the live, undrained nodes, weight = free bytes
(DRAM + SSD) x ramp, where ramp grows linearly from ``ramp_floor`` to 1 over ``ramp_seconds``
after a node joins. Proportional shares (not "pick the emptiest") keep one empty node from
taking every new scope between two reports, and the ramp keeps a node that just joined from
being flooded.

An operator drains a node before removing it (``drain``): it gets no new scopes, a session
placed there is placed anew, and its pages stay readable until it goes. The drained set is
kept in Ray's GCS (``actors/drain.py``), so a restarted coordinator finds it again.

A node whose Ray node died is *lost* (``actors/node_records.py``): Ray cannot restart its
actor elsewhere (it is pinned to its node), so it takes no new scopes from the moment Ray
declares its Ray node dead, its row says what DRAM it lost, and its NodeID is kept for a node
that comes back on its host with its root (and its SSD scopes).

State is soft: on (re)start the coordinator asks every storage node it finds by name for its
NodeID, start time, usage and sessions, and carries on from that. Nodes keep their NodeIDs.
This is a plain class; ``flatcake_ray/client/deploy.py`` wraps it with ``ray.remote``.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import OrderedDict
from typing import Any

from flatcake_ray.actors.auth import service_gate
from flatcake_ray.actors.drain import read_drained, write_drained
from flatcake_ray.actors.lost import forget_lost, read_lost, record_of, remember_lost
from flatcake_ray.actors.node_records import NodeRecord, RayNodeWatch, check_registration, ramp
from flatcake_ray.actors.protocol import NO_LOCAL_NODE, NODE_NAME_PREFIX, NodeUsage
from flatcake_ray.actors.tenant_admin import TenantAdmin
from flatcake_ray.config import ServiceConfig
from flatcake_ray.core.gva import MAX_NODE_ID
from flatcake_ray.core.put_checks import check_session_id
from flatcake_ray.errors import ServiceError, UnknownNodeError

log = logging.getLogger(__name__)
MAX_SESSIONS = 1 << 20  # session -> node entries kept (oldest forgotten first)
REBUILD_TIMEOUT_S = 5.0


def _node_id(value: object) -> int:
    """A NodeID a caller names: an int (a list would be an untyped TypeError as a dict key)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnknownNodeError(f"a NodeID is an int, not {type(value).__name__}")
    return value


class CapacityCoordinator:
    def __init__(self, config: ServiceConfig, service_secret: str, *, rebuild: bool = True) -> None:
        """``rebuild``: take the cluster's state (storage nodes, drained set, tenants) from
        Ray and keep the drained set and tenants there; False for a coordinator used as a
        plain object, without Ray."""
        self.config = config
        self.gate = service_gate(config, service_secret, in_gcs=rebuild)
        self.tenants = TenantAdmin(self.gate, service_secret, in_gcs=rebuild)
        self._service_secret = service_secret
        self.nodes: dict[int, NodeRecord] = {}
        self.sessions: OrderedDict[tuple[str, Any], int] = OrderedDict()
        self.started_at = time.time()
        self.counters = {"registrations": 0, "placements": 0, "rebuilt_nodes": 0, "reports": 0}
        self.counters["placements_local"] = 0
        self._in_gcs = rebuild
        # Ray's view of which Ray nodes are dead (a lost node: actors/node_records.py); a
        # coordinator without Ray only knows whether reports arrive.
        self.watch = RayNodeWatch() if rebuild else None
        self.drained: frozenset[int] = frozenset()
        if rebuild:
            self.drained = read_drained(config.namespace)
            self._rebuild()

    # ---- membership ------------------------------------------------------------------------
    def register(
        self,
        service_secret: object,
        ray_node_id: str,
        actor_name: str,
        wanted_node_id: int | None,
        started_at: float,
    ) -> int:
        """The NodeID of this storage node: its old one if free, else the lowest free one.
        Only the service's own nodes (holding its secret) register."""
        self.gate.service(service_secret)
        check_registration(ray_node_id, actor_name, wanted_node_id, started_at)
        if self.watch is not None:  # a fresh view: the newcomer is alive, a lost holder dead
            self.watch.dead(ray_node_id, fresh=True)
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
                self._forget(wanted)
                return wanted
        for node_id in range(NO_LOCAL_NODE + 1, MAX_NODE_ID + 1):
            # A drained NodeID stays reserved for the node that has it (it may come back).
            if node_id not in self.nodes and node_id not in self.drained:
                return node_id
        raise ServiceError(f"all {MAX_NODE_ID} NodeIDs are in use")

    def report(
        self, service_secret: object, node_id: int, ray_node_id: str, usage: NodeUsage
    ) -> bool:
        """A node's periodic usage report; False tells it to register again (we forgot it)."""
        self.gate.service(service_secret)
        if not isinstance(usage, NodeUsage):
            raise ServiceError(f"a report carries NodeUsage, not {type(usage).__name__}")
        record = self.nodes.get(_node_id(node_id))
        if record is None or record.ray_node_id != ray_node_id:
            return False
        record.usage = usage
        record.last_seen = time.time()
        self.counters["reports"] += 1
        for other in list(self.nodes.values()):  # note losses as they come, status or not
            self._lost(other)
        return True

    def forget(self, service_secret: object, node_id: int) -> None:
        self.gate.service(service_secret)
        self._forget(_node_id(node_id))

    def _forget(self, node_id: int) -> None:
        record = self.nodes.pop(node_id, None)
        if record is not None and record.lost_noted and self._in_gcs:
            forget_lost(self.config.namespace, node_id)

    def _alive(self, record: NodeRecord, now: float) -> bool:
        """Reporting, on a Ray node Ray calls alive (a lost node's NodeID may be given to
        the node that comes back on its host with its root)."""
        return now - record.last_seen < self.config.node_timeout_s and not self._lost(record)

    def _lost(self, record: NodeRecord) -> bool:
        if self.watch is None or not self.watch.dead(record.ray_node_id):
            return False
        if not record.lost_noted:  # first sight: kept in the GCS for a restarted coordinator
            record.lost_noted = True
            if self._in_gcs:
                remember_lost(self.config.namespace, record)
            log.warning("NodeID %d lost: Ray node %s is dead", record.node_id, record.ray_node_id)
        return True

    # ---- draining --------------------------------------------------------------------------
    def drain(self, service_secret: object, node_id: int) -> dict[str, Any]:
        """Place no new scope on this node (its pages stay readable); returns its row."""
        self.gate.service(service_secret)
        if _node_id(node_id) not in self.nodes:
            known = ", ".join(str(n) for n in sorted(self.nodes)) or "none"
            raise UnknownNodeError(f"no storage node has NodeID {node_id} (known: {known})")
        self._set_drained(self.drained | {node_id})
        log.info("NodeID %d drained: no new scopes are placed there", node_id)
        return self.nodes_table_row(node_id)

    def undrain(self, service_secret: object, node_id: int) -> bool:
        """Place scopes on this node again; False if it was not drained."""
        self.gate.service(service_secret)
        if _node_id(node_id) not in self.drained:
            return False
        self._set_drained(self.drained - {node_id})
        log.info("NodeID %d undrained", node_id)
        return True

    def _set_drained(self, node_ids: frozenset[int]) -> None:
        if self._in_gcs:  # stored first: a failed write changes nothing here either
            write_drained(self.config.namespace, node_ids)
        self.drained = node_ids

    def _placeable(self, record: NodeRecord, now: float) -> bool:
        return record.node_id not in self.drained and self._alive(record, now)

    # ---- placement -------------------------------------------------------------------------
    def place_scope(self, secret: object, session_id: Any = None, prefer: Any = None) -> int:
        """The NodeID that holds (or will hold) this session of the caller's tenant: where it
        already is; else ``prefer`` (the writer's own node) while it has room; else the
        capacity-weighted choice (docs/placement.md)."""
        tenant = self.gate.tenant(secret).name
        if session_id is not None:
            session_id = check_session_id(session_id)
        now = time.time()
        key = (tenant, session_id)
        if session_id is not None:
            known = self.sessions.get(key)
            if (
                known is not None
                and known in self.nodes
                and self._placeable(self.nodes[known], now)
            ):
                self.sessions.move_to_end(key)
                return known
        node_id = self._local_first(prefer, now)
        if node_id is None:
            node_id = self._choose(now)
        if session_id is not None:
            self.sessions[key] = node_id
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        self.counters["placements"] += 1
        return node_id

    def _local_first(self, prefer: Any, now: float) -> int | None:
        """``prefer`` if it takes scopes and has room: at least half the mean free bytes of
        the live nodes (so the common put is local, and a full node sends its writers'
        sessions where the room is)."""
        record = self.nodes.get(prefer) if isinstance(prefer, int) else None
        if record is None or record.usage is None or not self._placeable(record, now):
            return None
        live = [r for r in self.nodes.values() if self._placeable(r, now) and r.usage]
        mean_free = sum(r.usage.free_bytes for r in live if r.usage) / max(1, len(live))
        if record.usage.free_bytes * 2 < mean_free:
            return None
        self.counters["placements_local"] += 1
        return record.node_id

    def _choose(self, now: float) -> int:
        live = [r for r in self.nodes.values() if self._placeable(r, now)]
        if not live:
            raise ServiceError(
                f"no live storage node to place a scope on ({len(self.drained)} drained)"
            )
        reported = [r.usage.free_bytes for r in live if r.usage is not None]
        # A node that has not reported yet weighs what the reported ones weigh on average
        # (all alike when none has): the first reporter must not take every scope placed
        # while the others' first reports are on their way.
        unknown = statistics.mean(reported) if reported else 1.0
        weights = {r.node_id: self._weight(r, now, unknown) for r in live}
        total = sum(weights.values())
        for record in live:
            record.credit += weights[record.node_id]
        chosen = max(live, key=lambda r: (r.credit, -r.node_id))
        chosen.credit -= total
        chosen.placed += 1
        return chosen.node_id

    def _weight(self, record: NodeRecord, now: float, unknown: float) -> float:
        free = record.usage.free_bytes if record.usage is not None else unknown
        return max(1.0, float(free)) * ramp(record, now, self.config)

    # ---- views -----------------------------------------------------------------------------
    def nodes_table(self, service_secret: object) -> list[dict[str, Any]]:
        self.gate.service(service_secret)
        return [self.nodes_table_row(n) for n in sorted(self.nodes)]

    def nodes_table_row(self, node_id: int) -> dict[str, Any]:
        record = self.nodes[node_id]
        row = record.row(time.time(), self.config, self._lost(record))
        return {**row, "drained": node_id in self.drained}

    def info(self, service_secret: object) -> dict[str, Any]:
        self.gate.service(service_secret)
        return {
            "started_at": self.started_at,
            "nodes": len(self.nodes),
            "sessions": len(self.sessions),
            "drained": sorted(self.drained),  # those gone too, until undrained
            "lost": sorted(n for n, r in self.nodes.items() if self._lost(r)),
            **self.counters,
            **self.gate.counters,
        }

    def ping(self) -> str:
        return "ok"

    def service_config(self, service_secret: object) -> dict[str, Any]:
        """The config this service was started with (``start`` checks its geometry)."""
        self.gate.service(service_secret)
        return self.config.to_dict()

    # ---- tenants (``actors/tenant_admin.py``) ------------------------------------------------
    def add_tenant(
        self,
        service_secret: object,
        name: str,
        layers: int,
        page_bytes: int,
        quota_dram: int | None = None,
        quota_ssd: int | None = None,
    ) -> str:
        """Create a tenant; returns its secret (shown once, kept nowhere)."""
        self.gate.service(service_secret)
        secret = self.tenants.add(name, layers, page_bytes, quota_dram, quota_ssd)
        self._push_tenants()
        return secret

    def set_tenant_quota(
        self, service_secret: object, name: str, quota_dram: int | None, quota_ssd: int | None
    ) -> None:
        self.gate.service(service_secret)
        self.tenants.set_quota(name, quota_dram, quota_ssd)
        self._push_tenants()

    def remove_tenant(self, service_secret: object, name: str) -> None:
        self.gate.service(service_secret)
        self.tenants.remove(name)
        self._push_tenants()

    def list_tenants(self, service_secret: object) -> list[dict[str, Any]]:
        self.gate.service(service_secret)
        return self.tenants.rows()

    def _push_tenants(self) -> None:
        """Have every live node re-read the table now, so a tenant command has taken effect
        everywhere when it returns (a node that does not answer reads it on its next report)."""
        if not self._in_gcs:
            return
        import ray
        from ray.exceptions import RayError

        refs: list[Any] = []
        for record in list(self.nodes.values()):
            try:
                handle = ray.get_actor(record.actor_name, namespace=self.config.namespace)
            except ValueError:  # gone; it re-reads the table when it comes back
                continue
            refs.append(handle.refresh_tenants.remote(self._service_secret))
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.rpc_timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except RayError as exc:
                log.warning("a storage node did not re-read the tenant table: %s", exc)

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
        refs: dict[str, Any] = {}
        for name in names:
            try:
                handle = ray.get_actor(name, namespace=self.config.namespace)
            except ValueError:  # gone between the listing and now
                continue
            refs[name] = handle.coordinator_view.remote(self._service_secret)
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=REBUILD_TIMEOUT_S)
        for name, ref in refs.items():
            if ref in ready:
                self._adopt_view(name, ref)
        for node_id, stored in read_lost(self.config.namespace).items():
            if node_id in self.nodes:  # taken by a node that came back: no longer lost
                forget_lost(self.config.namespace, node_id)
            else:
                self.nodes[node_id] = record_of(node_id, stored)

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
        for tenant, session_id in view["sessions"]:
            self.sessions[(tenant, session_id)] = node_id
        self.counters["rebuilt_nodes"] += 1
