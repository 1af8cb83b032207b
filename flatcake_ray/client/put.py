"""Puts through the Ray service, a layer at a time: the client's side of the one put path.

:class:`RemotePut` (a ``PutWriter``) opens the put on its owner (``begin_put``), whose ticket
(:class:`~flatcake_ray.actors.protocol.PutTarget`) names the memory the bytes go to, and
writes each layer there as the engine produces it: a DRAM put straight into the owner's
arena (mapped on the owner's node; one NIXL WRITE from another), an SSD put into the owner's
landing slots, which the owner writes to its drive (``land``, at most one call per slot in
flight, so memory stays bounded whatever the context length). Where neither is reachable
(no NIXL between the nodes, or the owner's landing area is full), the layer's bytes ride in
the ``land`` call: the labelled last resort. The owner publishes the keys only after the last
layer landed (``commit_put``); an abandoned put is aborted by the owner after its TTL.
:class:`~flatcake_ray.client.owners.OwnerChooser` picks the node a put goes to.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from flatcake_ray.actors.protocol import PutMemory, PutTarget, PutTicket
from flatcake_ray.client.nodes import NodeLink, NodeTable
from flatcake_ray.client.put_targets import PutTargets
from flatcake_ray.core.api import PutResult
from flatcake_ray.core.integrity import block_checksums
from flatcake_ray.cuda_ext.host_copy import copy_into
from flatcake_ray.cuda_ext.host_hash import copy_hashing_source
from flatcake_ray.errors import (
    CallLostError,
    ChannelClosedError,
    ForeignMemoryError,
    ServiceError,
    ShapeError,
    StoreWriteError,
)
from flatcake_ray.media.buffers import as_layer_bytes

log = logging.getLogger(__name__)
IN_FLIGHT = 2  # inline layers of one put crossing at once


class Reach(Enum):
    """How this client gets a layer's bytes into the owner's memory."""

    MAPPED = "mapped"  # the owner is on this node: its chunk, mapped here
    NIXL = "nixl"  # one-sided WRITE
    CALL = "call"  # LAST RESORT: in the ``land`` call


@dataclass(frozen=True)
class PutRoute:
    """Where a put goes and how this client reaches the owner's memory."""

    link: NodeLink
    nodes: NodeTable  # to mark the owner down when it does not answer
    targets: PutTargets
    nixl: bool  # the owner's exports are reachable over NIXL from here
    timeout_s: float


class RemotePut:
    def __init__(
        self,
        route: PutRoute,
        digests: np.ndarray,
        *,
        layers: int,
        page_bytes: int,
        options: dict[str, Any],
    ) -> None:
        """``digests``: the keys packed (``core.keys.request_digests``: the owner hashes
        nothing); ``options``: session_id, parent (packed too, or None), hints."""
        self._route = route
        self._digests = digests
        self._layers, self._page_bytes = layers, page_bytes
        self._options = options
        self._ticket: PutTicket | None = None
        self._landing: deque[tuple[Any, int]] = deque()  # land calls in flight, their bytes
        self._in_place: list[int] = []  # layers written into the owner's memory, not landed
        self._in_place_sums: list[np.ndarray] = []  # their checksums, as written
        self._written: set[int] = set()
        self._done = False
        # The owner ended the put itself: one of its calls failed there (``land`` and
        # ``commit_put`` abort on any failure) or the owner is gone; nothing left to abort.
        self._ended_there = False
        self.inline_layers = 0  # layers sent in the call (the last resort)

    @property
    def pages_new(self) -> int:
        """Pages the owner will write (known once the put is open there)."""
        return len(self._digests) if self._ticket is None else self._ticket.pages_new

    # ---- writes ----------------------------------------------------------------------------
    def write_layer(self, layer: int, pages: Any) -> None:
        self._check_live()
        if not isinstance(layer, int) or not 0 <= layer < self._layers:
            raise ShapeError(f"layer {layer!r} outside 0..{self._layers - 1}")
        if layer in self._written:
            raise StoreWriteError(f"layer {layer} was already written")
        data = as_layer_bytes(pages, len(self._digests), self._page_bytes)
        try:
            self._send(self._open().target, layer, data)
        except BaseException:
            self.abort()
            raise
        self._written.add(layer)

    def _open(self) -> PutTicket:
        if self._ticket is None:
            options = self._options
            args = (None, options["session_id"], options["parent"], options["hints"])
            self._ticket = self._ask("begin_put", self._digests, *args)
        return self._ticket

    def _send(self, target: PutTarget, layer: int, data: np.ndarray) -> None:
        if target.memory is PutMemory.NONE:
            return  # every key is stored already
        positions = None if len(target.new_positions) == len(data) else target.new_positions
        reach = self._reach(target)
        if reach is Reach.CALL:
            self._land(layer, data if positions is None else data[positions])
            return
        whole = len(target.offsets) >= self._layers  # DRAM, or every layer has its slot
        if not whole:
            while len(self._landing) >= len(target.offsets):
                self._settle_oldest()  # the slot's previous layer is on the drive
        offset = target.offsets[layer % len(target.offsets)]
        # What this client wrote, from its own copy: the owner keeps these checksums, so a
        # write by anyone else into that shared memory is a failed check, never our bytes.
        sums = self._place(target, reach, offset, data, positions)
        if sums is None:
            written = data if positions is None else data[positions]
            sums = block_checksums(written.reshape(-1), target.check_pages * self._page_bytes)
        if whole:
            self._in_place.append(layer)
            self._in_place_sums.append(sums)
        else:
            self._land(layer, None, sums)

    def _reach(self, target: PutTarget) -> Reach:
        if target.memory is PutMemory.INLINE:
            return Reach.CALL
        if self._link.local:
            return Reach.MAPPED
        return Reach.NIXL if self._route.nixl and target.peer is not None else Reach.CALL

    def _place(
        self, target: PutTarget, reach: Reach, offset: int, data: np.ndarray, positions: Any
    ) -> np.ndarray | None:
        """Write the layer's new pages into the owner's memory; their block checksums when
        they were taken on the way (one pass: a write of the whole layer), else None."""
        block_bytes = target.check_pages * self._page_bytes
        if reach is Reach.NIXL:
            return self._route.targets.write(target.peer, offset, data, positions, block_bytes)
        count = len(data) if positions is None else len(positions)
        try:
            memory = self._route.targets.mapped(self._link, target)
        except ForeignMemoryError as exc:
            # The ticket's chunk is the tenant's while the put lives: refused, the put is over
            # (expired or aborted there; its chunk was emptied and maybe renewed since).
            raise StoreWriteError(
                f"put {self._ticket.put_id if self._ticket else '?'}: its owner no longer "
                f"holds the memory it was given ({exc}); the put expired or was aborted"
            ) from exc
        start = offset - target.chunk_offset
        into = memory[start : start + count * self._page_bytes].reshape(count, -1)
        if positions is not None:
            np.take(data, positions, axis=0, out=into)
            return None
        sums = copy_hashing_source(into, data, block_bytes)
        if sums is None:
            copy_into(into, data)
        return sums

    def _land(self, layer: int, inline: np.ndarray | None, sums: np.ndarray | None = None) -> None:
        assert self._ticket is not None
        if inline is not None:
            while len(self._landing) >= IN_FLIGHT:
                self._settle_oldest()
            inline = np.ascontiguousarray(inline).reshape(-1)
            self.inline_layers += 1
        ref = self._link.handle.land.remote(self._ticket.put_id, layer, inline, sums)
        self._landing.append((ref, 0 if inline is None else inline.nbytes))

    # ---- completion ------------------------------------------------------------------------
    def commit(self) -> PutResult:
        self._check_live()
        missing = sorted(set(range(self._layers)) - self._written)
        if missing:
            self.abort()
            raise StoreWriteError(f"commit before layers {missing[:8]} were written")
        try:
            ticket = self._open()
            while self._landing:
                self._settle_oldest()
            result = self._ask(
                "commit_put", ticket.put_id, tuple(self._in_place), tuple(self._in_place_sums)
            )
        except BaseException:
            self.abort()
            raise
        self._done = True
        return result

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        while self._landing:  # the owner may still read a slot until its call returns
            self._wait_quietly(self._landing.popleft()[0])
        if self._ticket is not None and not self._ended_there:
            self._link.handle.abort_put.remote(self._ticket.put_id)  # fire and forget

    # ---- plumbing --------------------------------------------------------------------------
    @property
    def _link(self) -> NodeLink:
        return self._route.link

    def _ask(self, method: str, *args: Any) -> Any:
        """The owner's answer to ``method``: over its call channel where it has one
        (client/direct.py), else (or when the channel cannot carry it) Ray.
        A commit whose answer was lost is not sent again: the owner may have published."""
        direct = self._link.direct
        if direct is not None:
            try:
                return self._answered(direct.call, method, *args)
            except CallLostError as exc:
                if method == "commit_put":
                    self._route.nodes.mark_down(self._link, f"commit lost: {exc}")
                    node = self._link.node_id
                    raise ServiceError(
                        f"storage node {node} did not answer the commit (it may still publish; "
                        "a retry is safe: write-once)"
                    ) from exc
                log.info("%s over Ray: %s", method, exc)
            except ChannelClosedError as exc:
                log.info("%s over Ray: %s", method, exc)
        return self._call(getattr(self._link.handle, method).remote(*args))

    def _settle_oldest(self) -> None:
        ref, nbytes = self._landing.popleft()
        self._call(ref, nbytes)

    def _call(self, ref: Any, nbytes: int = 0) -> Any:
        """The owner's answer; a node that does not answer is marked down (ServiceError)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        # A big layer takes longer: allow it at least 200 MB/s on top of the RPC timeout.
        timeout = self._route.timeout_s + nbytes / 200e6
        try:
            return self._answered(ray.get, ref, timeout=timeout)
        except (RayActorError, GetTimeoutError) as exc:
            self._ended_there |= isinstance(exc, RayActorError)
            self._route.nodes.mark_down(self._link, f"put failed: {exc}")
            node = self._link.node_id
            raise ServiceError(f"storage node {node} did not take the put: {exc}") from exc

    def _wait_quietly(self, ref: Any) -> None:
        import ray
        from ray.exceptions import RayError

        try:
            self._answered(ray.get, ref, timeout=self._route.timeout_s)
        except (RayError, StoreWriteError, ShapeError) as exc:  # aborting anyway
            log.info("a layer of an aborted put failed: %s", exc)

    def _answered(self, wait: Any, *args: Any, **kwargs: Any) -> Any:
        """``wait(*args)``: the owner's answer to a call of this put; an error the owner
        raised (typed, or Ray's task error carrying it) means it ended the put there."""
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return wait(*args, **kwargs)
        except (CallLostError, ChannelClosedError, GetTimeoutError, RayActorError):
            raise  # no answer: the put may still be open there
        except Exception:
            self._ended_there = True
            raise

    def _check_live(self) -> None:
        if self._done:
            raise StoreWriteError("this put was already committed or aborted")

    def __enter__(self) -> RemotePut:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()
