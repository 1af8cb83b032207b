"""Finding a request's pages across nodes, with O(nodes touched) calls and no coordinator.

A session's pages live on the node the coordinator placed its scope on, contiguous from the
chain's first page. The :class:`Locator` keeps a cache: first-page digest -> NodeID, filled by
this client's puts and earlier hits. A request whose first key is cached costs one call to
that node (``lookup``: index probe and lease; or ``exists``). Otherwise, or when the cached
node no longer has the pages, every live node is asked once, in parallel, and the longest
prefix wins (the others' leases are released): one round trip of N calls, then cached. A
node that does not answer within the RPC timeout is marked down; its pages are misses.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from flatcake_ray.actors.protocol import LeaseReply
from flatcake_ray.client.nodes import NodeLink, NodeTable
from flatcake_ray.client.report import RestoreReport
from flatcake_ray.core.api import Probe

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
        self,
        method: str,
        keys: Sequence[Any],
        namespace: str | None,
        first: bytes,
        report: RestoreReport,
    ) -> tuple[NodeLink | None, Any]:
        """The node with the longest prefix for ``keys`` and its answer (see module doc)."""
        tried: set[int] = set()
        cached = self._where.get(first)
        link = self.nodes.get(cached) if cached is not None else None
        if link is not None and link.is_up(time.monotonic()):
            answers = self.call_all([link], method, keys, namespace, report)
            if answers and hits(answers[0][1]):
                return answers[0]
            tried.add(link.node_id)
        self.nodes.refresh()
        others = [n for n in self.nodes.up() if n.node_id not in tried]
        self.fanouts += 1
        answers = self.call_all(others, method, keys, namespace, report)
        if not answers:
            return None, None
        best = max(answers, key=lambda a: hits(a[1]))
        for link, answer in answers:
            if link is not best[0] and isinstance(answer, LeaseReply) and answer.hits:
                self.release(link, answer, (), report)
        if hits(best[1]):
            self.remember(first, best[0].node_id)
        return best

    def call_all(
        self,
        links: list[NodeLink],
        method: str,
        keys: Sequence[Any],
        namespace: str | None,
        report: RestoreReport,
    ) -> list[tuple[NodeLink, Any]]:
        import ray
        from ray.exceptions import RayError

        if not links:
            return []
        refs = {getattr(link.handle, method).remote(keys, namespace): link for link in links}
        report.actor_calls += len(refs)
        report.nodes_asked += len(refs)
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=self.rpc_timeout_s)
        for ref in late:  # a late lease runs out by its TTL
            self.nodes.mark_down(refs[ref], f"{method} took over {self.rpc_timeout_s}s")
        answers = []
        for ref in ready:
            try:
                answers.append((refs[ref], ray.get(ref)))
            except RayError as exc:
                self.nodes.mark_down(refs[ref], f"{method} failed: {exc}")
                report.failures.append(f"node {refs[ref].node_id}: {type(exc).__name__}")
        return answers

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
