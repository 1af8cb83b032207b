"""Giving leases back: the :class:`~flatcake_ray.client.locate.Locator`'s half that
releases what its lookups leased.

Three ways, by what the reader needs: ``release_held`` (a reader that kept bytes it did not
check: it waits for the node's answer, and drops what it read on False);
``release_unawaited`` (a reader that checked every byte it kept: sent and not waited for,
over the local node's call channel or over Ray, and ``settle_unawaited`` orders such releases
before this client's next put); ``let_go`` (a lease nobody read under: its id
rides on the next ``lookup`` to that node, or goes alone after ``RELEASE_CARRY_S``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from flatcake_ray.actors.protocol import LeaseReply
from flatcake_ray.client.nodes import NodeLink, NodeTable
from flatcake_ray.client.report import RestoreReport
from flatcake_ray.errors import ChannelClosedError, FlatCakeError

# A lease let go of without an answer rides on the next lookup to its node; one that no
# lookup carried within this long is released by a call of its own (scopes stay pinned that
# much longer at most).
RELEASE_CARRY_S = 0.05
# Releases sent and not waited for are looked over (the answered ones dropped) this often.
UNAWAITED_PRUNE = 64


class LeaseReleases:
    def __init__(self, nodes: NodeTable, rpc_timeout_s: float) -> None:
        self.nodes = nodes
        self.rpc_timeout_s = rpc_timeout_s
        self._lock = threading.Lock()
        self._let_go: dict[int, list[int]] = {}  # node id -> lease ids not yet sent
        self._wake = threading.Event()
        self.release_calls = 0  # releases no lookup carried, sent by themselves
        self.releases_unawaited = 0  # releases of checked reads, sent and not waited for
        self._unawaited: list[Any] = []  # their answers' references, until one settles them
        self._closed = False
        threading.Thread(target=self._send_uncarried, daemon=True).start()

    def release(
        self, link: NodeLink, reply: LeaseReply, bad_scopes: Iterable[int], report: RestoreReport
    ) -> Any:
        """Release a lease; returns the reference of the node's answer (True: the lease was
        held throughout, so what was read under it is good). Unread leases need no answer."""
        report.actor_calls += 1
        return link.handle.release.remote(reply.lease_id, list(bad_scopes))

    def release_unawaited(self, link: NodeLink, reply: LeaseReply, report: RestoreReport) -> None:
        """Release a lease read under whose reader needs no answer (it checked every byte
        it kept): sent now, its answer not waited for, over the node's call channel
        (posted: read by that connection's next call) or over Ray. A later call of this
        client may run at the node before it (another connection, another node thread):
        ``settle_unawaited`` is what orders it."""
        if link.direct is not None:
            try:
                link.direct.post("release", reply.lease_id, [])
            except ChannelClosedError:
                pass  # over Ray, below
            else:
                report.actor_calls += 1
                report.direct_calls += 1
                with self._lock:
                    self.releases_unawaited += 1
                return
        ref = self.release(link, reply, (), report)
        with self._lock:
            self._unawaited.append(ref)
            self.releases_unawaited += 1
            if len(self._unawaited) >= UNAWAITED_PRUNE:
                self._unawaited = self._pending(self._unawaited, 0.0)

    def _released_direct(
        self, link: NodeLink, reply: LeaseReply, bad_scopes: Iterable[int], report: RestoreReport
    ) -> bool | None:
        """The node's answer to a release over its call channel; None: the channel could not
        carry it (the caller releases over Ray)."""
        assert link.direct is not None
        report.actor_calls += 1
        try:
            good = bool(link.direct.call("release", reply.lease_id, list(bad_scopes)))
        except ChannelClosedError:
            return None
        except FlatCakeError as exc:
            report.failures.append(f"node {link.node_id}: release {type(exc).__name__}")
            return False
        report.direct_calls += 1
        return good

    def settle_unawaited(self) -> None:
        """Wait until every release sent by ``release_unawaited`` has run at its node (or
        failed there: its lease then ends by TTL). Called before a put, whose owner may
        evict: a lease of this client's still held there would keep its scopes, and what is
        evicted would depend on which of the two calls a node thread took first."""
        for link in self.nodes.up():
            if link.direct is not None:
                link.direct.settle()
        with self._lock:
            refs, self._unawaited = self._unawaited, []
        left = self._pending(refs, self.rpc_timeout_s)
        if left:
            with self._lock:
                self._unawaited.extend(left)

    @staticmethod
    def _pending(refs: list[Any], timeout_s: float) -> list[Any]:
        """Those of ``refs`` not answered within ``timeout_s`` (the answers are not read: a
        release's outcome matters only to a reader that did not check what it read)."""
        if not refs:
            return refs
        import ray

        _, left = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)
        return left

    def let_go(self, link: NodeLink, reply: LeaseReply) -> None:
        """Give back a lease no reader used and nobody waits on: its id goes with the next
        ``lookup`` to that node (no call of its own), or alone after ``RELEASE_CARRY_S``."""
        with self._lock:
            self._let_go.setdefault(link.node_id, []).append(reply.lease_id)
        self._wake.set()

    def _carrying(self, link: NodeLink, method: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``args`` of a ``lookup`` with the leases let go of at ``link`` (see ``let_go``)."""
        if method != "lookup" or len(args) != 1:
            return args
        with self._lock:
            ids = self._let_go.pop(link.node_id, None)
        return args if not ids else (*args, None, np.asarray(ids, dtype=np.int64))

    def send_let_go(self) -> None:
        """Release, one call each, every lease let go of that no lookup has carried yet."""
        with self._lock:
            pending, self._let_go = self._let_go, {}
        for node_id, ids in pending.items():
            link = self.nodes.get(node_id)
            if link is None:  # the node is gone: the TTL frees its leases
                continue
            for lease_id in ids:
                link.handle.release.remote(lease_id, [])
                self.release_calls += 1

    def _send_uncarried(self) -> None:
        while not self._closed:
            self._wake.wait()
            time.sleep(RELEASE_CARRY_S)
            self._wake.clear()
            self.send_let_go()

    def close(self) -> None:
        """Send what was let go of, and stop the thread that sends it."""
        self._closed = True
        self._wake.set()
        self.send_let_go()

    def release_held(
        self, link: NodeLink, reply: LeaseReply, bad_scopes: Iterable[int], report: RestoreReport
    ) -> bool:
        """Release a lease that was read under, and wait for the answer: False (the lease
        ran out, was never this tenant's, or a scope went; or no answer) means drop what was
        read."""
        import ray
        from ray.exceptions import RayError

        if link.direct is not None:
            good = self._released_direct(link, reply, bad_scopes, report)
            if good is not None:
                return good
        ref = self.release(link, reply, bad_scopes, report)
        try:
            return bool(ray.get(ref, timeout=self.rpc_timeout_s))
        except RayError as exc:
            report.failures.append(f"node {link.node_id}: release {type(exc).__name__}")
            return False
