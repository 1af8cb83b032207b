"""Puts through the Ray service, a layer at a time: the client's side of the one put path.

:class:`RemotePut` (a ``PutWriter``) sends a put's layers to the owner's ``PutHandle`` as the
engine produces them. The bytes travel through a region of the client's staging arena: shared
memory the owner maps (same node), pulled with one NIXL READ (other node), or, as the
labelled last resort, inline in the call. A put whose every layer fits one region
(``put_region_bytes``) is sent whole at commit in one call (``put_staged``); a larger one opens
a put on the owner (``begin_put``), sends each layer as it comes (pieces of at most a region,
two in flight, so memory stays bounded whatever the context length) and commits. The owner
publishes the keys only after the last layer landed; an abandoned put is aborted by the owner
after its TTL. :class:`OwnerChooser` picks the node a put goes to.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flatcake_ray.actors.protocol import (
    COORDINATOR_NAME,
    PutTicket,
    StagedPages,
    StagedPiece,
    StagingKind,
)
from flatcake_ray.client.locate import Locator
from flatcake_ray.client.nodes import NodeLink, NodeTable
from flatcake_ray.client.report import RestoreReport
from flatcake_ray.client.source import first_digest
from flatcake_ray.client.staging import Region, StagingArena
from flatcake_ray.core.api import PutResult
from flatcake_ray.core.keys import KeyLike, PageKey
from flatcake_ray.errors import ServiceError, ShapeError, StoreWriteError
from flatcake_ray.media.buffers import as_layer_bytes
from flatcake_ray.transports.base import REMOTE_DRAM_NIXL

log = logging.getLogger(__name__)
IN_FLIGHT = 2  # pieces of one put crossing at once


@dataclass(frozen=True)
class PutRoute:
    """Where a put goes and how its bytes travel."""

    link: NodeLink
    nodes: NodeTable  # to mark the owner down when it does not answer
    kind: StagingKind
    arena: StagingArena
    region_bytes: int
    timeout_s: float


class RemotePut:
    def __init__(
        self,
        route: PutRoute,
        keys: Sequence[KeyLike | PageKey],
        *,
        layers: int,
        page_bytes: int,
        options: dict[str, Any],
    ) -> None:
        self._route = route
        self._keys = list(keys)
        self._layers, self._page_bytes = layers, page_bytes
        self._options = options  # namespace, session_id, parent, hints
        self._layer_bytes = len(self._keys) * page_bytes
        self._whole = layers * self._layer_bytes <= route.region_bytes
        self._region: Region | None = None  # the whole put's region
        self._ticket: PutTicket | None = None
        self._in_flight: deque[tuple[Any, Region]] = deque()
        self._written: set[int] = set()
        self._done = False

    @property
    def pages_new(self) -> int:
        """Pages the owner will write (known once the put is open there)."""
        return len(self._keys) if self._ticket is None else self._ticket.pages_new

    # ---- writes ----------------------------------------------------------------------------
    def write_layer(self, layer: int, pages: Any) -> None:
        self._check_live()
        if not isinstance(layer, int) or not 0 <= layer < self._layers:
            raise ShapeError(f"layer {layer!r} outside 0..{self._layers - 1}")
        if layer in self._written:
            raise StoreWriteError(f"layer {layer} was already written")
        data = as_layer_bytes(pages, len(self._keys), self._page_bytes)
        try:
            if self._whole:
                self._stage_whole(layer, data)
            else:
                self._send_layer(layer, data)
        except BaseException:
            self.abort()
            raise
        self._written.add(layer)

    def _stage_whole(self, layer: int, data: np.ndarray) -> None:
        if self._region is None:
            total = self._layers * self._layer_bytes
            self._region = self._route.arena.take(total, self._route.timeout_s)
        at = layer * self._layer_bytes
        self._region.view[at : at + self._layer_bytes] = data.reshape(-1)

    def _send_layer(self, layer: int, data: np.ndarray) -> None:
        if self._ticket is None:
            self._ticket = self._call(
                self._link.handle.begin_put.remote(self._keys, **self._options)
            )
        per_piece = max(1, self._route.region_bytes // self._page_bytes)
        for first in range(0, len(self._keys), per_piece):
            count = min(per_piece, len(self._keys) - first)
            while len(self._in_flight) >= IN_FLIGHT:
                self._settle_oldest()
            region = self._route.arena.take(count * self._page_bytes, self._route.timeout_s)
            region.view[: count * self._page_bytes] = data[first : first + count].reshape(-1)
            staged = self._staged(region, (StagedPiece(layer, first, count, region.offset),))
            ref = self._link.handle.write_pages.remote(self._ticket.put_id, staged)
            self._in_flight.append((ref, region))

    def _staged(self, region: Region, pieces: tuple[StagedPiece, ...]) -> StagedPages:
        kind, segment = self._route.kind, region.segment
        staged = StagedPages(kind, self._page_bytes, pieces, region.offset, region.nbytes)
        if kind is StagingKind.INLINE:
            return dataclasses.replace(staged, inline=region.view.copy())
        if kind is StagingKind.SHM:
            return dataclasses.replace(
                staged, path=segment.path, token=segment.token, buffer_bytes=segment.nbytes
            )
        return dataclasses.replace(staged, peer=segment.peer())

    # ---- completion ------------------------------------------------------------------------
    def commit(self) -> PutResult:
        self._check_live()
        missing = sorted(set(range(self._layers)) - self._written)
        if missing:
            self.abort()
            raise StoreWriteError(f"commit before layers {missing[:8]} were written")
        try:
            result = self._commit_whole() if self._whole else self._commit_open()
        except BaseException:
            self.abort()
            raise
        self._done = True
        return result

    def _commit_whole(self) -> PutResult:
        assert self._region is not None
        pieces = tuple(
            StagedPiece(layer, 0, len(self._keys), self._region.offset + layer * self._layer_bytes)
            for layer in range(self._layers)
        )
        staged = self._staged(self._region, pieces)
        ref = self._link.handle.put_staged.remote(self._keys, staged, **self._options)
        try:
            return self._call(ref, self._region.nbytes)
        finally:
            self._route.arena.give(self._region)
            self._region = None

    def _commit_open(self) -> PutResult:
        assert self._ticket is not None
        while self._in_flight:
            self._settle_oldest()
        return self._call(self._link.handle.commit_put.remote(self._ticket.put_id))

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        if self._ticket is not None:
            self._link.handle.abort_put.remote(self._ticket.put_id)  # fire and forget
        while self._in_flight:  # the owner may still read a region until its call returns
            ref, region = self._in_flight.popleft()
            self._wait_quietly(ref)
            self._route.arena.give(region)
        if self._region is not None:
            self._route.arena.give(self._region)
            self._region = None

    # ---- plumbing --------------------------------------------------------------------------
    @property
    def _link(self) -> NodeLink:
        return self._route.link

    def _settle_oldest(self) -> None:
        ref, region = self._in_flight.popleft()
        try:
            self._call(ref, region.nbytes)
        finally:
            self._route.arena.give(region)

    def _call(self, ref: Any, nbytes: int = 0) -> Any:
        """The owner's answer; a node that does not answer is marked down (ServiceError)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        # A big piece takes longer: allow it at least 200 MB/s on top of the RPC timeout.
        timeout = self._route.timeout_s + nbytes / 200e6
        try:
            return ray.get(ref, timeout=timeout)
        except (RayActorError, GetTimeoutError) as exc:
            self._route.nodes.mark_down(self._link, f"put failed: {exc}")
            node = self._link.node_id
            raise ServiceError(f"storage node {node} did not take the put: {exc}") from exc

    def _wait_quietly(self, ref: Any) -> None:
        import ray
        from ray.exceptions import RayError

        try:
            ray.get(ref, timeout=self._route.timeout_s)
        except (RayError, StoreWriteError) as exc:  # aborting anyway: the put is gone
            log.info("a piece of an aborted put failed: %s", exc)

    def _check_live(self) -> None:
        if self._done:
            raise StoreWriteError("this put was already committed or aborted")

    def __enter__(self) -> RemotePut:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


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
        namespace: str | None,
        session_id: str | None,
        parent: Any,
        report: RestoreReport,
    ) -> NodeLink:
        self.nodes.refresh()  # a drained node stops taking this client's sessions too
        known = self.sessions.get(session_id) if session_id is not None else None
        if known is None and session_id is None:
            if parent is not None:  # continue the chain where its parent is
                parent_first = first_digest([parent], namespace)
                holder, found = self.locator.ask(
                    "exists", [parent], namespace, parent_first, report
                )
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

    def remember(self, first: bytes, session_id: str | None, node_id: int) -> None:
        self.locator.remember(first, node_id)
        if session_id is not None:
            self.sessions[session_id] = node_id
            while len(self.sessions) > 1 << 16:
                self.sessions.popitem(last=False)

    def _placed(self, session_id: str | None, report: RestoreReport) -> NodeLink:
        import ray
        from ray.exceptions import RayError

        self.nodes.refresh()
        try:
            coordinator = ray.get_actor(COORDINATOR_NAME, namespace=self.namespace)
            report.actor_calls += 1
            ref: Any = coordinator.place_scope.remote(self.nodes.secret, session_id)
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
        local = [link for link in up if link.local]
        return local[0] if local else up[0]


def staging_kind(link: NodeLink, allowed: frozenset[str]) -> StagingKind:
    if link.local:
        return StagingKind.SHM
    if REMOTE_DRAM_NIXL in link.available(allowed):
        return StagingKind.NIXL
    return StagingKind.INLINE
