"""Finding a request's pages across nodes in a bounded number of calls, whatever the cluster
size, and no coordinator.

A session's pages live on the node the coordinator placed its scope on, contiguous from the
chain's first page. A request is named by its *anchor* (``core/homes.py``: its page at depth
``HOME_DEPTH``, so chains that share a first page do not share their homes). The
:class:`Locator` keeps a cache: anchor digest -> NodeID, filled by this client's puts and
earlier hits. A request whose anchor is cached costs one call to that node (``lookup``:
index probe and lease; or ``exists``), and its answer is final (no hits: the entry is
dropped and the request misses); a lease let go of unread (``locate(lease=True)``) is
released by the next ``lookup`` to its node, in that call. Otherwise the chain's two *homes*
(the first two rendezvous candidates of the anchor over the live nodes, computed here) are
asked in parallel with ``find``: each answers the lookup itself and, when it does not hold
the whole request, the owner it recorded. A named owner is asked next (the longest answer
wins). So a miss costs 2
calls (one round trip) and a hit at most 3 nodes, at any N. A put records its chain at both
homes, so one node joining or leaving leaves one of them holding the record; a record found
only at the second is re-recorded at the first (not awaited). When a home on this client's
machine (asked over its call channel, ``client/direct.py``) answers the whole request, the
lookup ends with it: the other home's Ray answer is read later (at the next lookup, or before
this client's next put or stats), and what it leased goes back then (``_settle_late``).

Asking every live node is kept only as a counted recovery (``fanouts``): when a home did not
answer (its records may be what is missing), at most once per chain per membership (the set
of live NodeIDs), never for a plain miss. A node that does not answer in the RPC timeout is
marked down.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import numpy as np

from flatcake_ray.actors.homes import Found
from flatcake_ray.actors.protocol import LeaseReply
from flatcake_ray.client.direct import DIRECT_CALLS, PendingCall
from flatcake_ray.client.nodes import NodeLink, NodeTable
from flatcake_ray.client.releases import LeaseReleases
from flatcake_ray.client.report import RestoreReport
from flatcake_ray.core.api import Probe
from flatcake_ray.core.homes import anchor_index, anchor_of, home_candidates
from flatcake_ray.errors import (
    AccessDeniedError,
    ChannelClosedError,
    FlatCakeError,
    TenantLimitError,
)

LOCATION_CACHE_ENTRIES = 1 << 17


def hits(answer: LeaseReply | Probe | int | None) -> int:
    """Pages found, from a lookup (LeaseReply), probe (Probe) or exists (int) answer."""
    if answer is None:
        return 0
    return int(answer) if isinstance(answer, int | np.integer) else int(answer.hits)


class Locator(LeaseReleases):
    def __init__(self, nodes: NodeTable, rpc_timeout_s: float) -> None:
        super().__init__(nodes, rpc_timeout_s)
        self._where: OrderedDict[bytes, int] = OrderedDict()
        self.fanouts = 0
        # Homes' finds a cold lookup did not wait for: (reference, home, the chain's anchor).
        self._late: list[tuple[Any, NodeLink, bytes]] = []
        self.finds_unawaited = 0
        self._recovered: OrderedDict[tuple[bytes, frozenset[int]], None] = OrderedDict()

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

    def _drop(self, first: bytes) -> None:
        with self._lock:
            self._where.pop(first, None)

    def ask(
        self, method: str, digests: np.ndarray, report: RestoreReport
    ) -> tuple[NodeLink | None, Any]:
        """The node with the longest prefix for a request (its packed ``digests``) and its
        answer (see module doc)."""
        self._settle_late(0.0)
        first = anchor_of(digests)
        known = self._where.get(first)
        cached = self.nodes.get(known) if known is not None else None
        if cached is not None and cached.is_up(time.monotonic()):
            answers = self.call_all([cached], method, (digests,), report)
            if answers and hits(answers[0][1]):
                return answers[0]
            if answers:  # the owner said no: final (dropped, so the next request asks homes)
                self._drop(first)
                return answers[0]
        self.nodes.refresh()
        up = {link.node_id: link for link in self.nodes.up()}
        homes = [up[node_id] for node_id in home_candidates(first, up)]
        found, failed = self._ask_homes(homes, method, digests, first, report)
        if found is not None or not failed:
            return found if found is not None else (None, None)
        return self._recover(first, list(up.values()), method, digests, report, homes)

    def _ask_homes(
        self,
        homes: list[NodeLink],
        method: str,
        digests: np.ndarray,
        first: bytes,
        report: RestoreReport,
    ) -> tuple[tuple[NodeLink, Any] | None, bool]:
        """Ask the chain's homes (``find``, in parallel), then the owner they recorded: the
        longest prefix found (or None), and whether some home did not answer."""
        found = self.call_all(homes, "find", (method, digests), report, whole=first)
        failed = len(found) < len(homes)
        answers = [(link, reply.answer) for link, reply in found]
        owners = [reply.owner for _, reply in found if reply.owner is not None]
        # A home holding part of the request (a shared first page) still names the owner
        # of the whole: asked too, the longest answer wins (the others' leases go back).
        if owners and max(hits(answer) for _, answer in answers) < len(digests):
            link = self.nodes.get(owners[0])
            if link is not None and link not in homes and link.is_up(time.monotonic()):
                answers += self.call_all([link], method, (digests,), report)
        best = self._best(answers, report)
        if best is None or hits(best[1]) <= anchor_index(len(digests)):
            return best, failed  # none, or short of the anchor: nothing to remember or record
        self.remember(first, best[0].node_id)
        # A home that knew nothing (it became a home since the put) learns the owner now.
        unaware = [link for link, reply in found if reply.owner is None and link is not best[0]]
        if unaware:
            report.actor_calls += self._record_at(unaware, first, best[0].node_id)
        return best, failed

    def _best(
        self, answers: list[tuple[NodeLink, Any]], report: RestoreReport
    ) -> tuple[NodeLink, Any] | None:
        """The longest prefix among ``answers`` (the others' leases released), or None."""
        best = max(answers, key=lambda a: hits(a[1]), default=None)
        if best is None or not hits(best[1]):
            return None
        for link, answer in answers:
            if link is not best[0] and isinstance(answer, LeaseReply) and answer.hits:
                self.release(link, answer, (), report)
        return best

    def _recover(
        self,
        first: bytes,
        up: list[NodeLink],
        method: str,
        digests: np.ndarray,
        report: RestoreReport,
        homes: list[NodeLink],
    ) -> tuple[NodeLink | None, Any]:
        """A home did not answer, so its record may be what is missing: ask every other live
        node once, at most once per chain per membership (counted in ``fanouts``)."""
        membership = frozenset(link.node_id for link in up)
        if (first, membership) in self._recovered:
            return None, None
        with self._lock:
            self._recovered[(first, membership)] = None
            while len(self._recovered) > LOCATION_CACHE_ENTRIES:
                self._recovered.popitem(last=False)
        self.fanouts += 1
        others = [link for link in self.nodes.up() if link not in homes]
        answers = self.call_all(others, method, (digests,), report)
        best = self._best(answers, report)
        if best is None:
            return None, None
        self.remember(first, best[0].node_id)
        return best

    def record_home(self, first: bytes, owner: int) -> int:
        """Tell the homes of page ``first`` (a chain's anchor, or its tail) which node holds
        it (not awaited); returns calls made."""
        homes = home_candidates(first, [link.node_id for link in self.nodes.up()])
        links = [self.nodes.get(home) for home in homes if home != owner]
        return self._record_at([link for link in links if link is not None], first, owner)

    @staticmethod
    def _record_at(links: list[NodeLink], first: bytes, owner: int) -> int:
        for link in links:
            link.handle.record_home.remote(first, owner)
        return len(links)

    def call_all(
        self,
        links: list[NodeLink],
        method: str,
        args: tuple[Any, ...],
        report: RestoreReport,
        *,
        whole: bytes | None = None,
    ) -> list[tuple[NodeLink, Any]]:
        """Each node's answer to ``method(*args)``, asked in parallel; a node that fails or
        does not answer in the RPC timeout is marked down and left out. ``whole`` (homes'
        ``find``s of the chain anchored there): when a home answers the whole request over
        its call channel, the Ray calls' answers are not waited for (``_settle_late``)."""
        import ray
        from ray.exceptions import RayError, RayTaskError

        if not links:
            return []
        refs: dict[Any, NodeLink] = {}
        direct: list[tuple[NodeLink, tuple[Any, ...]]] = []
        for link in links:
            sent = self._carrying(link, method, args)
            if link.direct is not None and method in DIRECT_CALLS:
                direct.append((link, sent))  # asked once the Ray calls are on their way
            else:
                refs[getattr(link.handle, method).remote(*sent)] = link
        report.actor_calls += len(links)
        report.nodes_asked += len(links)
        answers: list[tuple[NodeLink, Any]] = []
        limited: FlatCakeError | None = None
        pending: list[tuple[NodeLink, tuple[Any, ...], PendingCall]] = []
        for link, sent in sorted(direct, key=lambda d: not d[0].local):  # local answers first
            try:
                pending.append((link, sent, link.direct.send(method, *sent)))  # type: ignore[union-attr]
            except ChannelClosedError:  # asked over Ray instead
                refs[getattr(link.handle, method).remote(*sent)] = link
        # Every call sent is read (their round trips overlapped): a connection is not held
        # for an answer nobody waits on, and a home that knew nothing is told at once.
        for link, sent, call in pending:
            try:
                answers.append((link, call.result()))
                report.direct_calls += 1
            except ChannelClosedError:  # asked over Ray instead
                refs[getattr(link.handle, method).remote(*sent)] = link
            except (TenantLimitError, AccessDeniedError) as exc:
                limited = exc
            except FlatCakeError as exc:  # what a Ray call would raise as a RayTaskError
                self.nodes.mark_down(link, f"{method} failed: {exc}")
                report.failures.append(f"node {link.node_id}: {type(exc).__name__}")
        if whole is not None and refs and any(_holds(a, len(args[1])) for _, a in answers):
            with self._lock:
                self._late += [(ref, link, whole) for ref, link in refs.items()]
                self.finds_unawaited += len(refs)
            refs = {}
        ready: list[Any] = []
        late: list[Any] = []
        if refs:
            ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=self.rpc_timeout_s)
        for ref in late:  # a late lease runs out by its TTL
            self.nodes.mark_down(refs[ref], f"{method} took over {self.rpc_timeout_s}s")
        for ref in ready:
            try:
                answers.append((refs[ref], ray.get(ref)))
            # The node is up and refuses this tenant (over a limit, or not let in): the
            # caller's error, typed as the node raised it, not the node's failure.
            except TenantLimitError as exc:
                limited = TenantLimitError(_message(exc, RayTaskError))
            except AccessDeniedError as exc:
                limited = AccessDeniedError(_message(exc, RayTaskError))
            except RayError as exc:
                self.nodes.mark_down(refs[ref], f"{method} failed: {exc}")
                report.failures.append(f"node {refs[ref].node_id}: {type(exc).__name__}")
        if limited is not None:
            for link, answer in answers:  # what the other nodes leased goes back at once
                if isinstance(answer, LeaseReply) and answer.hits:
                    self.release(link, answer, (), report)
            raise limited
        return [answer for answer in answers if self._current(*answer, report)]

    def _settle_late(self, timeout_s: float, *, give_up: bool = False) -> None:
        """Read the homes' answers a cold lookup did not wait for (another home had answered
        the whole request): give back what they leased, and tell a home that knew nothing
        where the chain is, as a lookup that waited would have. Those not answered within
        ``timeout_s`` stay for the next time, or, with ``give_up``, their homes are marked
        down (what they leased runs out by its TTL)."""
        with self._lock:
            late, self._late = self._late, []
        if not late:
            return
        import ray
        from ray.exceptions import RayError

        ready, _ = ray.wait([ref for ref, _, _ in late], num_returns=len(late), timeout=timeout_s)
        answered, kept = set(ready), []
        for ref, link, first in late:
            if ref not in answered:
                if give_up:
                    self.nodes.mark_down(link, f"find took over {timeout_s}s")
                else:
                    kept.append((ref, link, first))
                continue
            try:
                reply = ray.get(ref)
            except (TenantLimitError, AccessDeniedError):
                continue  # refused this tenant: nothing was leased
            except RayError as exc:
                self.nodes.mark_down(link, f"find failed: {exc}")
                continue
            if isinstance(reply.answer, LeaseReply) and reply.answer.hits:
                self.release_unawaited(link, reply.answer, RestoreReport(0))
            owner = self._where.get(first)
            if reply.owner is None and owner is not None and owner != link.node_id:
                self._record_at([link], first, owner)
        with self._lock:
            self._late += kept

    def settle_unawaited(self) -> None:
        """The homes' answers not waited for first (their leases released), then every
        release not waited for (``LeaseReleases.settle_unawaited``)."""
        self._settle_late(self.rpc_timeout_s, give_up=True)
        super().settle_unawaited()

    def _current(self, link: NodeLink, answer: Any, report: RestoreReport) -> bool:
        """False for a lease from a node that restarted since ``link`` described it: the
        link's mappings are the dead process's (its old arena), so nothing is read through
        it. The lease is given back, the node described anew, and the request misses there."""
        if isinstance(answer, Found):
            answer = answer.answer
        if not isinstance(answer, LeaseReply) or answer.epoch == link.description.started_at:
            return True
        if answer.hits:
            self.release(link, answer, (), report)
        report.failures.append(f"node {link.node_id}: restarted (epoch {answer.epoch:.3f})")
        self.nodes.renew(link)
        return False


def _holds(answer: Any, pages: int) -> bool:
    """A home's ``find`` answer that holds the whole request of ``pages`` pages."""
    return isinstance(answer, Found) and hits(answer.answer) >= pages


def _message(exc: BaseException, wrapper: type) -> str:
    """What the node said, without Ray's wrapping of a remote error."""
    return str(exc.cause if isinstance(exc, wrapper) else exc)  # type: ignore[attr-defined]
