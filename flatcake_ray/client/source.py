"""The Ray client's restore :class:`~flatcake_ray.restore.source.Source`: a lease held on some
storage node, read through the transports its GVAs route to.

``lease`` finds the node holding the prefix (``Locator``: the location cache, else one call to
every node) and takes its lease in the same call. Each medium of the lease is reached by the
path its GVA bits route to (``transports/routing.py``): the local arena is *mapped* (the
pipeline reads pages in place); everything else is *filled* into the pipeline's slots, with
the plan's coalesced reads: local SSD (O_DIRECT, or GDS into a GPU slot), remote DRAM (NIXL
or RDMA READ), remote SSD (NVMe-oF, or shipped by the owner), the labelled object-store
fallback last. A transport failure loses that chunk's pages (a miss, never wrong bytes);
a node that is gone is marked down. ``release`` hands checksum failures back to the owner
(which re-reads and quarantines) and withdraws the pages if the lease may have lapsed.

A lease may also be taken by one process and read under by another (``granted``): vLLM's
scheduler asks how much of a prompt is stored and leases it in the same call
(``FlatCakeClient.probe(lease=True)``: a :class:`LeaseGrant`), and the worker that loads the
blocks restores under that lease instead of asking the node again: one node call a hit, not
two. The grant names the digests it was taken for; a restore of other keys is refused.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flatcake_ray.actors.protocol import LeaseReply
from flatcake_ray.client.locate import Locator
from flatcake_ray.client.nodes import NodeLink, NodeTable
from flatcake_ray.client.report import RestoreReport
from flatcake_ray.config import ALIGN
from flatcake_ray.core.api import Probe
from flatcake_ray.core.chunks import SlotRead
from flatcake_ray.core.gva import MAX_OFFSET, Medium
from flatcake_ray.core.gva import encode as encode_gva
from flatcake_ray.core.keys import (
    KeyLike,
    PageKey,
    check_key_list,
    check_keys,
    digest_keys,
    request_digests,
    split_namespace,
)
from flatcake_ray.core.plan import MediumAccess
from flatcake_ray.errors import (
    LeaseError,
    PeerDisconnectedError,
    ReadRangeError,
    ShapeError,
    TransferError,
    TransferTimeoutError,
)
from flatcake_ray.failpoints import failpoint
from flatcake_ray.restore.source import (
    FillStats,
    Leased,
    MappedView,
    ReadOutcome,
    Slot,
    Source,
)
from flatcake_ray.transports.base import (
    LOCAL_DRAM,
    LOCAL_SSD,
    LOCAL_SSD_GDS,
    ReadBatch,
    ReadStream,
)
from flatcake_ray.transports.routing import route

LEASE_MARGIN_S = 1.0
logger = logging.getLogger(__name__)


@dataclass
class HeldLease:
    """The client's side of a lease: where it is held, the report it feeds, and the streams
    its announced fills read ahead on (closed at release)."""

    link: NodeLink | None
    reply: LeaseReply | None
    report: RestoreReport
    started: float
    streams: dict[Medium, ReadStream] = field(default_factory=dict)


@dataclass(frozen=True)
class LeaseGrant:
    """A lease taken for another process to read under (``TransportSource.granted``); it
    pickles, so it rides in an engine's step metadata from its scheduler to its workers."""

    reply: LeaseReply
    fingerprint: bytes  # of the packed digests leased (``grant_fingerprint``)
    taken_at: float  # time.time() when the node answered (the lease's TTL runs from there)


def grant_fingerprint(digests: np.ndarray) -> bytes:
    return hashlib.blake2b(digests.tobytes(), digest_size=16).digest()


def probe_of(answer: Any, digests: np.ndarray) -> Probe:
    """A node's ``probe`` answer, or its ``lookup`` answer as a probe holding the lease (a
    segment read from its DRAM replica is leased as the replica: not an SSD read)."""
    if isinstance(answer, Probe):
        return answer
    if isinstance(answer, LeaseReply) and answer.hits:
        on_ssd = any(part.medium is Medium.SSD for part in answer.parts)
        grant = LeaseGrant(answer, grant_fingerprint(digests), time.time())
        return Probe(answer.hits, on_ssd, grant)
    return Probe(0, False)


def first_digest(keys: Sequence[KeyLike | PageKey], namespace: str | None) -> bytes:
    """Check every key here (before any call) and digest the first: the location key."""
    check_key_list(keys)
    if len(keys) == 0:
        raise ShapeError("a call needs at least one key")
    resolved, bare = split_namespace(keys, namespace)
    check_keys(bare)
    return digest_keys(resolved, bare[:1]).tobytes()


def digests_of(keys: Sequence[KeyLike | PageKey], namespace: str | None) -> np.ndarray:
    """A request's keys checked and hashed here, once: what every node call carries."""
    check_key_list(keys)
    if len(keys) == 0:
        raise ShapeError("a call needs at least one key")
    return request_digests(keys, namespace)


def _batch(reads: Sequence[SlotRead]) -> ReadBatch:
    return ReadBatch(
        [r.src for r in reads], [r.length for r in reads], [r.slot_offset for r in reads]
    )


def _read_errors() -> tuple[type[BaseException], ...]:
    """What a failed path may raise: a transfer error, or the owner's own error carried by
    Ray (object-store fallback, shipped SSD). Each turns that chunk into a miss."""
    from ray.exceptions import RayError

    return (TransferError, ReadRangeError, OSError, RayError)


def _node_gone(exc: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(exc, PeerDisconnectedError | TransferTimeoutError | RayActorError)


class TransportSource(Source):
    fills_dram = True

    def __init__(
        self,
        nodes: NodeTable,
        locator: Locator,
        *,
        layers: int,
        page_bytes: int,
        allowed: frozenset[str],
        agents: Callable[[str], Any],
        lease_ttl_s: float,
        gds: bool,
        on_release: Callable[[HeldLease, ReadOutcome, int], None],
        seal_key: bytes | None = None,
    ) -> None:
        self.nodes, self.locator = nodes, locator
        self.layers, self.page_bytes = layers, page_bytes
        self.allowed = allowed
        self._agents = agents
        self._lease_ttl_s = lease_ttl_s
        self._gds = gds
        self._on_release = on_release
        self._seal_key = seal_key

    @property
    def seal_key(self) -> bytes | None:
        return self._seal_key

    def lease(self, keys: Sequence[KeyLike | PageKey], namespace: str | None) -> Leased:
        report = RestoreReport(len(keys))
        started = time.monotonic()
        link, reply = self.locator.ask("lookup", digests_of(keys, namespace), report)
        report.control_seconds = time.monotonic() - started
        if link is None or reply is None or not reply.hits:
            return Leased(0, (), HeldLease(None, None, report, started))
        report.node_id = link.node_id
        return Leased(reply.hits, reply.parts, HeldLease(link, reply, report, started))

    def granted(
        self, grant: Any, keys: Sequence[KeyLike | PageKey], namespace: str | None
    ) -> Leased:
        """The lease ``grant`` holds on ``keys``, where it can still be read under: the node
        is up, not restarted since, and the lease has time left; else a lease taken anew
        (the grant's given back where its node still answers)."""
        if not isinstance(grant, LeaseGrant):
            raise LeaseError(f"not a lease grant of this service: {grant!r}")
        digests = digests_of(keys, namespace)
        if grant_fingerprint(digests) != grant.fingerprint:
            raise LeaseError("a lease grant restores the keys it was taken for, no others")
        reply, report = grant.reply, RestoreReport(len(keys))
        link = self.nodes.get(reply.node_id) or self._refreshed(reply.node_id)
        if link is None or reply.epoch != link.description.started_at:
            return self.lease(keys, namespace)  # a node restarted since: its lease went too
        age = max(0.0, time.time() - grant.taken_at)
        if age > self._lease_ttl_s - 2 * LEASE_MARGIN_S or not link.is_up(time.monotonic()):
            self.locator.let_go(link, reply)
            return self.lease(keys, namespace)
        report.node_id = link.node_id
        held = HeldLease(link, reply, report, time.monotonic() - age)
        return Leased(reply.hits, reply.parts, held)

    def let_go(self, grant: Any) -> None:
        """Give back a grant's lease unread (it rides on the next lookup to its node)."""
        if not isinstance(grant, LeaseGrant):
            raise LeaseError(f"not a lease grant of this service: {grant!r}")
        link = self.nodes.get(grant.reply.node_id)
        if link is not None and grant.reply.epoch == link.description.started_at:
            self.locator.let_go(link, grant.reply)

    def _refreshed(self, node_id: int) -> NodeLink | None:
        """A node this process has not met yet (the grant was taken by another)."""
        self.nodes.refresh()
        return self.nodes.get(node_id)

    def path(self, leased: Leased, medium: Medium) -> str:
        link = leased.token.link
        gva = encode_gva(medium, link.node_id, 0)
        return route(gva, self.nodes.local_node_id, link.available(self.allowed))

    def access(self, leased: Leased, medium: Medium) -> MediumAccess:
        description = leased.token.link.description
        if medium is Medium.DRAM:
            mapped = self.path(leased, medium) == LOCAL_DRAM and self._handed(leased)
            return MediumAccess(mapped, description.verify_dram, MAX_OFFSET + 1)
        return MediumAccess(False, True, description.pool_file_bytes, ALIGN, description.gap_bytes)

    @staticmethod
    def _all_checked(leased: Leased) -> bool:
        """Whether a reader checks every block of the lease it delivers: SSD always, DRAM
        where the node says readers check it (``verify_dram``)."""
        has_dram = any(part.medium is Medium.DRAM for part in leased.parts)
        return not has_dram or leased.token.link.description.verify_dram

    def _handed(self, leased: Leased) -> bool:
        """Whether the leased DRAM segments lie in arena chunks this process maps (else they
        are read through the transport, which refuses them: misses, never a fault)."""
        transport, _ = leased.token.link.transport(LOCAL_DRAM, Medium.DRAM, self._agents)
        parts = [part for part in leased.parts if part.medium is Medium.DRAM]
        starts = np.array([part.offset for part in parts], dtype=np.int64)
        lengths = np.array([part.layout.nbytes for part in parts], dtype=np.int64)
        return bool(transport.holds(starts, lengths))

    def view(self, leased: Leased, medium: Medium) -> MappedView:
        transport, _ = leased.token.link.transport(LOCAL_DRAM, medium, self._agents)
        view = transport.mapped_view()
        assert view is not None  # routed local-dram: this process maps that arena
        return MappedView(view, LOCAL_DRAM)

    def announce(self, leased: Leased, fills: Sequence[tuple[Medium, Sequence[SlotRead]]]) -> None:
        held: HeldLease = leased.token
        link: NodeLink = leased.token.link  # set: a leased prefix has hits
        for medium in {m for m, _ in fills}:
            path = self.path(leased, medium)
            try:
                transport, lock = link.transport(path, medium, self._agents)
                if transport.reads_ahead:
                    batches = [_batch(reads) for m, reads in fills if m is medium]
                    held.streams[medium] = transport.open_stream(batches, lock)
            except _read_errors() as exc:  # the fills read one by one, and fail there if so
                logger.info("no read-ahead on %s: %s", path, exc)

    def fill(
        self, leased: Leased, medium: Medium, reads: Sequence[SlotRead], slot: Slot
    ) -> FillStats:
        held: HeldLease = leased.token
        link: NodeLink = leased.token.link  # set: a leased prefix has hits
        path = self.path(leased, medium)
        if path == LOCAL_SSD and self._gds and slot.device is not None and self.seal_key is None:
            path = LOCAL_SSD_GDS
        batch = _batch(reads)
        stream = held.streams.get(medium)
        try:
            failpoint("source.fill", medium=medium, path=path)
            if stream is not None:
                return self._fill_streamed(held, medium, path, stream, batch, slot)
            transport, lock = link.transport(path, medium, self._agents)
            with lock:
                calls = transport.actor_calls
                on_device = transport.destination == "device"
                stats = transport.read(batch, slot.device if on_device else slot.host)
                calls = transport.actor_calls - calls
        except _read_errors() as exc:
            if _node_gone(exc):
                self.nodes.mark_down(link, f"{path}: {exc}")
            raise TransferError(f"{path}: {exc}") from exc
        return FillStats(path, stats.bytes, stats.commands, stats.seconds, calls, on_device)

    @staticmethod
    def _fill_streamed(
        held: HeldLease, medium: Medium, path: str, stream: ReadStream, batch: ReadBatch, slot: Slot
    ) -> FillStats:
        calls = stream.actor_calls
        assert slot.host is not None  # a path that reads ahead fills host slots
        try:
            stats = stream.read_next(batch, slot.host)
        except BaseException:
            # A broken stream is dropped: the fills after this one read one by one.
            held.streams.pop(medium, None)
            stream.close()
            raise
        return FillStats(
            path, stats.bytes, stats.commands, stats.seconds, stream.actor_calls - calls
        )

    def release(self, leased: Leased, outcome: ReadOutcome) -> int:
        held: HeldLease = leased.token
        pages = outcome.pages
        while held.streams:  # before the lease goes: a stopped stream frees its regions
            held.streams.popitem()[1].close()
        if held.link is not None and held.reply is not None:
            late = time.monotonic() - held.started > self._lease_ttl_s - LEASE_MARGIN_S
            if self._all_checked(leased) and not outcome.bad_scopes and not late:
                # Every byte delivered was checked, in this process's memory, against the
                # sums the lease named: a scope freed and written over while leased is a
                # miss already, so nothing waits for the owner's word. The release is sent
                # now all the same: a lease held on would keep its scopes from eviction.
                self.locator.release_unawaited(held.link, held.reply, held.report)
            else:
                bad = outcome.bad_scopes
                good = self.locator.release_held(held.link, held.reply, bad, held.report)
                if late or not good:
                    held.report.lease_expired = True  # the owner let go (or may have)
                    pages = 0
        self._on_release(held, outcome, pages)
        return pages
