"""Which node a put goes to (see :class:`OwnerChooser`)."""

from __future__ import annotations

import logging
import time
import zlib
from collections import OrderedDict
from typing import Any

import numpy as np

from flatcake_ray.actors.protocol import COORDINATOR_NAME, NO_LOCAL_NODE
from flatcake_ray.client.locate import Locator
from flatcake_ray.client.nodes import NodeLink, NodeTable
from flatcake_ray.client.report import RestoreReport
from flatcake_ray.core.homes import anchor_of, recorded_pages
from flatcake_ray.errors import ServiceError

log = logging.getLogger(__name__)


class OwnerChooser:
    """Which node a put goes to: where its chain or session already is, else where the
    coordinator places a new scope (if the coordinator is down: a node every client picks
    alike for the session, or this node)."""

    def __init__(self, nodes: NodeTable, locator: Locator, namespace: str, timeout_s: float):
        self.nodes, self.locator = nodes, locator
        self.namespace, self.timeout_s = namespace, timeout_s
        self.sessions: OrderedDict[str, int] = OrderedDict()

    def owner(
        self,
        first: bytes,
        session_id: str | None,
        parent: np.ndarray | None,
        report: RestoreReport,
    ) -> NodeLink:
        """The node a put goes to: its session's, else its parent's (``parent``: that key's
        packed digest, ``core.keys.parent_digest``), else where its chain is known to be,
        else one the coordinator places."""
        self.nodes.refresh()  # a drained node stops taking this client's sessions too
        known = self.sessions.get(session_id) if session_id is not None else None
        if known is None and session_id is None:
            if parent is not None:  # continue the chain where its parent is
                holder, found = self.locator.ask("exists", parent, report)
                known = holder.node_id if holder is not None and found else None
            else:
                known = self.locator.where(first)
        link = self.nodes.get(known) if known is not None else None
        # A drained node takes no new chain; a chain's tail stays beside its head (the tail
        # alone is never a prefix hit) until the node is removed.
        placeable = parent is not None or known not in self.nodes.drained
        if link is not None and link.is_up(time.monotonic()) and placeable:
            return link
        return self._placed(session_id, report)

    def remember(
        self,
        digests: np.ndarray,
        session_id: str | None,
        node_id: int,
        *,
        continues: bool,
        report: RestoreReport,
    ) -> None:
        """A put of ``digests`` (one row a page) goes to ``node_id``: this client keeps its
        chain and session there, and the homes of its anchor (a chain's head) and of its
        tail (where a continuation goes) learn it (``core/homes.py``; not awaited)."""
        self.locator.remember(anchor_of(digests), node_id)
        if session_id is not None:
            self.sessions[session_id] = node_id
            while len(self.sessions) > 1 << 16:
                self.sessions.popitem(last=False)
        for page in recorded_pages(len(digests), continues=continues):
            named = bytes(digests[page : page + 1].tobytes())
            report.actor_calls += self.locator.record_home(named, node_id)

    def _placed(self, session_id: str | None, report: RestoreReport) -> NodeLink:
        import ray
        from ray.exceptions import RayError

        self.nodes.refresh()
        try:
            coordinator = ray.get_actor(COORDINATOR_NAME, namespace=self.namespace)
            report.actor_calls += 1
            local = self.nodes.local_node_id  # the writer's own node first, while it has room
            prefer = None if local == NO_LOCAL_NODE else local
            ref: Any = coordinator.place_scope.remote(self.nodes.secret, session_id, prefer)
            node_id: int = ray.get(ref, timeout=self.timeout_s)
            if self.nodes.get(node_id) is None:  # a node that joined since the last refresh
                self.nodes.refresh(force=True)
            link = self.nodes.get(node_id)
            if link is not None and link.is_up(time.monotonic()):
                return link
        except (RayError, ValueError, ServiceError) as exc:
            log.warning("coordinator unavailable for placement (%s); placing locally", exc)
        drained = self.nodes.drained
        up = sorted(
            (link for link in self.nodes.up() if link.node_id not in drained),
            key=lambda link: link.node_id,
        )
        if not up:
            raise ServiceError("no undrained storage node is up")
        if session_id is not None:
            # The same choice in every client (a stable hash), so concurrent writers of one
            # session still meet on one node while the coordinator is away.
            return up[zlib.crc32(str(session_id).encode()) % len(up)]
        here = [link for link in up if link.local]
        return here[0] if here else up[0]
