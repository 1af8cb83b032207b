"""Finding a request's pages across nodes, with O(nodes touched) calls and no coordinator.

A session's pages live on the node the coordinator placed its scope on, contiguous from the
chain's first page. The :class:`Locator` keeps a cache: first-page digest -> NodeID, filled by
this client's puts and earlier hits. A request whose first key is cached costs one call to
that node (``lookup``: index probe and lease; or ``exists``). Otherwise the chain's *home*
(``core/homes.py``: rendezvous hashing of the first digest over the live nodes, computed
here) is asked; if it is not the owner, one more call asks it which node the writer
recorded, and that node is asked: at most three calls, whatever the cluster size. Only when
all of that misses (the home changed with the node set, or restarted) is every live node
asked once, in parallel, the longest prefix winning (the others' leases are released); the
answer is cached. A node that does not answer in the RPC timeout is marked down.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from flatcake_ray.actors.protocol import LeaseReply
from flatcake_ray.client.nodes import NodeLink, NodeTable
from flatcake_ray.client.report import RestoreReport
from flatcake_ray.core.api import Probe
from flatcake_ray.core.homes import home_node
from flatcake_ray.errors import TenantLimitError

LOCATION_CACHE_ENTRIES = 1 << 17


def hits(answer: LeaseReply | Probe | int | None) -> int:
    """Pages found, from a lookup (LeaseReply), probe (Probe) or exists (int) answer."""
    if answer is None:
        return 0
    return int(answer) if isinstance(answer, int | np.integer) else int(answer.hits)


class Locator:
    def __init__(self, nodes: NodeTable, rpc_timeout_s: float) -> None:
        self.nodes = nodes
        self.rpc_timeout_s = rpc_timeout_s
        self._where: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()
        self.fanouts = 0

    def where(self, first: bytes) -> int | None:
        return self._where.get(first)

    def forget(self) -> None:
        with self._lock:
            self._where.clear()

    def remember(self, first: bytes, node_id: int) -> None:
        with self._lock:
            self._where[first] = node_id
            self._where.move_to_end(first)
            while len(self._where) > LOCATION_CACHE_ENTRIES:
                self._where.popitem(last=False)

    def ask(
        self, method: str, digests: np.ndarray, report: RestoreReport
    ) -> tuple[NodeLink | None, Any]:
        """The node with the longest prefix for a request (its packed ``digests``) and its
        answer (see module doc)."""
        first = digests[:1].tobytes()
        tried: set[int] = set()
        found = self._try(self._where.get(first), method, digests, report, tried)
        if found is not None:
            return found
        self.nodes.refresh()
        home = home_node(first, [link.node_id for link in self.nodes.up()])
        for node_id in (home, self._recorded_owner(home, first, report)):
            found = self._try(node_id, method, digests, report, tried)
            if found is not None:
                self.remember(first, found[0].node_id)
                return found
        others = [n for n in self.nodes.up() if n.node_id not in tried]
        self.fanouts += 1
        answers = self.call_all(others, method, digests, report)
        if not answers:
            return None, None
        best = max(answers, key=lambda a: hits(a[1]))
        for link, answer in answers:
            if link is not best[0] and isinstance(answer, LeaseReply) and answer.hits:
                self.release(link, answer, (), report)
        if hits(best[1]):
            self.remember(first, best[0].node_id)
        return best

    def _try(
        self,
        node_id: int | None,
        method: str,
        digests: np.ndarray,
        report: RestoreReport,
        tried: set[int],
    ) -> tuple[NodeLink, Any] | None:
        """``node_id``'s answer if it has the prefix (each node is asked once per request)."""
        link = self.nodes.get(node_id) if node_id is not None else None
        if link is None or node_id in tried or not link.is_up(time.monotonic()):
            return None
        tried.add(link.node_id)
        answers = self.call_all([link], method, digests, report)
        return answers[0] if answers and hits(answers[0][1]) else None

    def _recorded_owner(self, home: int | None, first: bytes, report: RestoreReport) -> int | None:
        """The owner the chain's home recorded (one call), or None."""
        import ray
        from ray.exceptions import RayError

        link = self.nodes.get(home) if home is not None else None
        if link is None or not link.is_up(time.monotonic()):
            return None
        report.actor_calls += 1
        try:
            return ray.get(link.handle.home_of.remote(first), timeout=self.rpc_timeout_s)
        except RayError as exc:
            self.nodes.mark_down(link, f"home_of failed: {exc}")
            return None

    def record_home(self, first: bytes, owner: int) -> int:
        """Tell the chain's home which node owns it (not awaited); returns calls made."""
        home = home_node(first, [link.node_id for link in self.nodes.up()])
        link = self.nodes.get(home) if home is not None else None
        if link is None or home == owner:
            return 0
        link.handle.record_home.remote(first, owner)
        return 1

    def call_all(
        self,
        links: list[NodeLink],
        method: str,
        digests: np.ndarray,
        report: RestoreReport,
    ) -> list[tuple[NodeLink, Any]]:
        import ray
        from ray.exceptions import RayError, RayTaskError

        if not links:
            return []
        refs = {getattr(link.handle, method).remote(digests): link for link in links}
        report.actor_calls += len(refs)
        report.nodes_asked += len(refs)
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=self.rpc_timeout_s)
        for ref in late:  # a late lease runs out by its TTL
            self.nodes.mark_down(refs[ref], f"{method} took over {self.rpc_timeout_s}s")
        answers, limited = [], None
        for ref in ready:
            try:
                answers.append((refs[ref], ray.get(ref)))
            except TenantLimitError as exc:  # the node is up: this tenant is over its limit
                limited = TenantLimitError(str(exc.cause if isinstance(exc, RayTaskError) else exc))
            except RayError as exc:
                self.nodes.mark_down(refs[ref], f"{method} failed: {exc}")
                report.failures.append(f"node {refs[ref].node_id}: {type(exc).__name__}")
        if limited is not None:
            for link, answer in answers:  # what the other nodes leased goes back at once
                if isinstance(answer, LeaseReply) and answer.hits:
                    self.release(link, answer, (), report)
            raise limited
        return [answer for answer in answers if self._current(*answer, report)]

    def _current(self, link: NodeLink, answer: Any, report: RestoreReport) -> bool:
        """False for a lease from a node that restarted since ``link`` described it: the
        link's mappings are the dead process's (its old arena), so nothing is read through
        it. The lease is given back, the node described anew, and the request misses there."""
        if not isinstance(answer, LeaseReply) or answer.epoch == link.description.started_at:
            return True
        if answer.hits:
            self.release(link, answer, (), report)
        report.failures.append(f"node {link.node_id}: restarted (epoch {answer.epoch:.3f})")
        self.nodes.renew(link)
        return False

    def release(
        self, link: NodeLink, reply: LeaseReply, bad_scopes: Iterable[int], report: RestoreReport
    ) -> Any:
        """Release a lease; returns the reference of the node's answer (True: the lease was
        held throughout, so what was read under it is good). Unread leases need no answer."""
        report.actor_calls += 1
        return link.handle.release.remote(reply.lease_id, list(bad_scopes))

    def release_held(
        self, link: NodeLink, reply: LeaseReply, bad_scopes: Iterable[int], report: RestoreReport
    ) -> bool:
        """Release a lease that was read under, and wait for the answer: False (the lease
        ran out, was never this tenant's, or a scope went; or no answer) means drop what was
        read."""
        import ray
        from ray.exceptions import RayError

        ref = self.release(link, reply, bad_scopes, report)
        try:
            return bool(ray.get(ref, timeout=self.rpc_timeout_s))
        except RayError as exc:
            report.failures.append(f"node {link.node_id}: release {type(exc).__name__}")
            return False
