"""A storage node's standing in the service: its NodeID and its reports to the coordinator.

The node registers with the coordinator (presenting the service secret) for its 12-bit
NodeID, kept in ``<root>/node_id`` so a restart keeps it, then reports its usage every
``report_interval_s`` while it changes. An idle node (usage as last sent) only keeps alive,
every third of ``node_timeout_s``: on a big cluster most nodes are idle most of the time,
and each report costs the coordinator, the GCS and the machine's cores (a cluster of many
nodes on few cores, as in ``flatcake-ray bench control``, slows every call with them). A
coordinator that answers a report with "unknown" restarted and lost this node: the node
registers again, and must get its own NodeID back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flatcake_ray.actors.protocol import COORDINATOR_NAME, NodeUsage
from flatcake_ray.config import ServiceConfig
from flatcake_ray.errors import ServiceError

log = logging.getLogger(__name__)


class Membership:
    def __init__(
        self,
        config: ServiceConfig,
        service_secret: str,
        ray_node_id: str,
        actor_name: str,
        started_at: float,
    ) -> None:
        self.config = config
        self._secret = service_secret
        self.ray_node_id = ray_node_id
        self.actor_name = actor_name
        self.started_at = started_at
        self.node_id = 0
        self._sent: NodeUsage | None = None  # the usage the coordinator has, and when sent
        self._sent_at = float("-inf")
        self._handle: Any = None

    def join(self, root: Path) -> int:
        """Register (keeping the NodeID persisted under ``root``) and persist the answer."""
        self.node_id = self._register(self._persisted(root))
        (root / "node_id").write_text(f"{self.node_id}\n")
        return self.node_id

    @staticmethod
    def _persisted(root: Path) -> int | None:
        path = root / "node_id"
        if not path.exists():
            return None
        text = path.read_text().strip()
        if not text.isdigit():
            raise ServiceError(f"{path} holds {text!r}, not a NodeID")
        return int(text)

    @property
    def keepalive_s(self) -> float:
        """An idle node's report interval: two may go missing before it counts silent."""
        return max(self.config.report_interval_s, self.config.node_timeout_s / 3)

    def _coordinator(self) -> Any:
        import ray

        if self._handle is None:  # looked up once (a GCS call), again after a failure
            self._handle = ray.get_actor(COORDINATOR_NAME, namespace=self.config.namespace)
        return self._handle

    def _register(self, wanted: int | None) -> int:
        import ray

        ref = self._coordinator().register.remote(
            self._secret, self.ray_node_id, self.actor_name, wanted, self.started_at
        )
        return int(ray.get(ref, timeout=self.config.rpc_timeout_s))

    def run(
        self, stop: threading.Event, tick: Callable[[], None], usage: Callable[[], NodeUsage]
    ) -> None:
        """The node's report thread until ``stop``: ``tick`` then a report, at once (placement
        weighs the node by its room from then on) and every ``report_interval_s`` after,
        sent only when due (see :meth:`report`)."""
        from ray.exceptions import RayError

        changed_only = False
        while True:
            try:
                tick()
                self.report(usage(), changed_only=changed_only)
            except (RayError, ValueError, ServiceError) as exc:
                # The coordinator or the GCS is down or restarting; the next report tries again.
                log.info("report to the coordinator failed: %s", exc)
            changed_only = True
            if stop.wait(self.config.report_interval_s):
                return

    def report(self, usage: NodeUsage, *, changed_only: bool = False) -> bool | None:
        """Send ``usage``; True when the coordinator knew this node (else it re-registers).
        ``changed_only``: None, nothing sent, when the coordinator has this usage already
        and the last report is younger than :attr:`keepalive_s`."""
        import ray
        from ray.exceptions import RayError

        now = time.monotonic()
        if changed_only and usage == self._sent and now - self._sent_at < self.keepalive_s:
            return None
        try:
            ref = self._coordinator().report.remote(
                self._secret, self.node_id, self.ray_node_id, usage
            )
            known = ray.get(ref, timeout=self.config.rpc_timeout_s)
        except RayError:
            self._handle = None  # a coordinator started anew has another handle
            raise
        if not known:  # a coordinator that lost us (restarted and we missed its rebuild)
            granted = self._register(self.node_id)
            if granted != self.node_id:
                raise ServiceError(
                    f"NodeID {self.node_id} was given to another node while the coordinator "
                    f"did not know this one (offered {granted}); restart this storage node"
                )
        self._sent, self._sent_at = usage, now
        return bool(known)
