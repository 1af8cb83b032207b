"""Remote DRAM over NIXL (UCX backend): one-sided READs of another node's arena.

Owner (StorageNode): ``NixlArenaExporter(name, arena, chunk_bytes=...)`` registers the arena
once per chunk; ``peer_info(offsets)`` is the picklable :class:`NixlPeerInfo` a reader needs
for those chunks only (NIXL's partial metadata: a peer that loaded it can name no other
chunk, ``docs/security.md``), sent in one Ray call.
Reader: ``NixlDramTransport(local_agent, peer_info)`` reads a :class:`ReadBatch` of arena
ranges with one NIXL transfer, one descriptor per range. On RDMA-capable UCX transports the
owner's CPU takes no part; over TCP UCX emulates READ with the owner's progress thread.
Puts go the other way through the same agent code: ``nixl_write.NixlDramWriter`` (WRITE).
The agent itself (registrations, transfers, progress) is ``nixl_agent.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flatcake_ray.core.runs import spans_cover
from flatcake_ray.errors import (
    ForeignMemoryError,
    TransferError,
    TransportClosedError,
)
from flatcake_ray.transports.base import (
    REMOTE_DRAM_NIXL,
    ReadBatch,
    TransferStats,
    Transport,
)
from flatcake_ray.transports.local_dram import split_at
from flatcake_ray.transports.nixl_agent import (
    DEFAULT_TIMEOUT_S,
    NixlAgent,
    buffer_address,
    nixl_probe,
)


@dataclass(frozen=True)
class NixlPeerInfo:
    """What a reader needs to reach chunks of an exported buffer; picklable for a Ray call.

    ``chunks``: the chunks ``metadata`` reaches, (offset, bytes) each, every one of them its
    own registration (a transfer never spans two); empty: none yet."""

    agent_name: str
    metadata: bytes
    base_address: int
    length: int
    chunks: tuple[tuple[int, int], ...] = ()

    def holds(self, starts: np.ndarray, lengths: np.ndarray) -> bool:
        """Whether every range lies inside :attr:`chunks`."""
        return spans_cover(self.chunks, starts, lengths)

    def learned(self, newer: NixlPeerInfo) -> NixlPeerInfo:
        """This peer with ``newer``'s chunks added (one export: same agent and buffer)."""
        chunks = tuple(sorted({*self.chunks, *newer.chunks}))
        return NixlPeerInfo(self.agent_name, self.metadata, self.base_address, self.length, chunks)

    def same_export(self, other: NixlPeerInfo) -> bool:
        return (self.agent_name, self.base_address, self.length) == (
            other.agent_name,
            other.base_address,
            other.length,
        )


_PEERS_KEPT = 256  # peer infos an exporter keeps made (one per set of chunks asked for)


class NixlArenaExporter:
    """Owner side: registers ``buffer`` with a NIXL agent for remote READs and WRITEs, one
    registration per ``chunk_bytes`` (0: one for the whole buffer).

    The buffer must stay alive and unmoved until ``close()``; the exporter keeps a reference.
    Pass ``agent`` to share one agent with this process's readers (it is then not closed).
    """

    def __init__(
        self,
        name: str,
        buffer: np.ndarray,
        *,
        agent: NixlAgent | None = None,
        chunk_bytes: int = 0,
    ) -> None:
        self._base = buffer_address(buffer)
        self._buffer = buffer
        self._owns_agent = agent is None
        self._agent = agent if agent is not None else NixlAgent(name)
        self.chunk_bytes = chunk_bytes or max(buffer.nbytes, 1)
        self._chunks = {
            start: buffer[start : start + self.chunk_bytes]
            for start in range(0, buffer.nbytes, self.chunk_bytes)
        }
        self._peers: dict[tuple[int, ...], NixlPeerInfo] = {}  # by the chunks they reach
        self._registrations: list[Any] | None = []
        try:
            for chunk in self._chunks.values():
                self._registrations.append(self._agent.register(chunk))
        except BaseException:
            self.close()
            raise

    @property
    def base_address(self) -> int:
        return self._base

    @property
    def length(self) -> int:
        return int(self._buffer.nbytes)

    def metadata(self) -> bytes:
        return self._agent.metadata()

    def peer_info(self, offsets: Iterable[int] | None = None) -> NixlPeerInfo:
        """What a peer needs to reach the chunks that start at ``offsets`` (None: every
        chunk), and only those."""
        wanted = tuple(sorted(self._chunks if offsets is None else set(offsets)))
        known = self._peers.get(wanted)
        if known is None:
            chunks = [self._chunks[offset] for offset in wanted]
            metadata = self._agent.partial_metadata(chunks)
            spans = tuple(
                (offset, int(chunk.nbytes)) for offset, chunk in zip(wanted, chunks, strict=True)
            )
            known = NixlPeerInfo(self._agent.name, metadata, self._base, self.length, spans)
            if len(self._peers) >= _PEERS_KEPT:
                self._peers.clear()
            self._peers[wanted] = known
        return known

    def renew(self, offset: int) -> None:
        """Register the chunk at ``offset`` again: its memory was given a fresh file
        (``DramArena.renew_chunk``), which a registration that pins pages (an RDMA NIC's)
        would not follow; the metadata handed out for it since is the new registration's."""
        if self._registrations is None:
            return
        index = offset // self.chunk_bytes
        self._agent.deregister(self._registrations[index])
        self._registrations[index] = self._agent.register(self._chunks[offset])
        self._peers.clear()

    def close(self) -> None:
        if self._registrations is None:
            return
        registrations, self._registrations = self._registrations, None
        try:
            for registration in registrations:
                self._agent.deregister(registration)
        finally:
            if self._owns_agent:
                self._agent.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def descriptors(addresses: np.ndarray, lengths: np.ndarray, device: int = 0) -> np.ndarray:
    device_column = np.full(addresses.shape, device, dtype=np.uint64)
    return np.column_stack((addresses.astype(np.uint64), lengths.astype(np.uint64), device_column))


class _NixlReader(Transport):
    """What the two NIXL transports share: validation, agent ownership, stats.

    A failed transfer breaks the transport for good: a request NIXL could not cancel might
    still complete later, so the connection is dropped and later reads are refused.
    """

    def __init__(self, agent: NixlAgent, owns_agent: bool, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self._agent: NixlAgent | None = agent
        self._owns_agent = owns_agent
        self._timeout_s = timeout_s
        self._broken: str | None = None

    @property
    def broken(self) -> bool:
        """True after a failed transfer: drop this transport and build a new one."""
        return self._broken is not None

    @property
    def _live_agent(self) -> NixlAgent:
        if self._agent is None:
            raise TransportClosedError(f"{self.name} transport is closed")
        return self._agent

    def _checked(self, reads: ReadBatch, dst: np.ndarray, size: int, source: str) -> ReadBatch:
        if self._agent is None:
            raise TransportClosedError(f"{self.name} transport is closed")
        if self._broken is not None:
            raise TransferError(f"{self.name} broke ({self._broken}); build a new one")
        reads.check_destination(dst)
        reads.check_source(size, source)
        return reads.nonempty()

    def _transfer(
        self, peer: str, reads: ReadBatch, dst: np.ndarray, remote: np.ndarray, kind: str
    ) -> TransferStats:
        start = time.perf_counter()
        agent = self._live_agent
        if len(reads):
            local = descriptors(dst.ctypes.data + reads.dst_offsets, reads.lengths)
            with agent.destinations.use(dst):
                try:
                    agent.read(peer, local, remote, kind, timeout_s=self._timeout_s, dst=dst)
                except TransferError as exc:
                    self._broken = type(exc).__name__
                    self._drop_connection()
                    raise
        elapsed = time.perf_counter() - start
        return TransferStats(reads.total_bytes, len(reads), elapsed, self.name)

    def _drop_connection(self) -> None:
        """Cut the path a late completion could take into a caller's buffer."""

    def _close_agent(self) -> None:
        agent, self._agent = self._agent, None
        if agent is not None and self._owns_agent:
            agent.close()


class NixlDramTransport(_NixlReader):
    """Reader side of remote DRAM over NIXL. Source offsets are offsets into the peer's arena.

    ``local_agent`` is a name (an agent is created and owned) or a shared :class:`NixlAgent`.
    Destination buffers are registered on first use and cached by address range (see
    :class:`RegistrationCache`): reuse one staging buffer, or slices of it, across reads.
    ``peer`` reaches some chunks of the arena; a read beyond them asks ``refresh`` once for
    the chunks reachable now (its tenant took more since), then is
    :class:`ForeignMemoryError` (a miss).
    """

    name = REMOTE_DRAM_NIXL

    def __init__(
        self,
        local_agent: str | NixlAgent,
        peer: NixlPeerInfo,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_registrations: int = 8,
        refresh: Callable[[], NixlPeerInfo | None] | None = None,
    ) -> None:
        if isinstance(local_agent, str):
            agent, owns = NixlAgent(local_agent, max_registrations=max_registrations), True
        else:
            agent, owns = local_agent, False
        super().__init__(agent, owns, timeout_s)
        self.peer = peer
        self._refresh = refresh
        try:
            self._peer_name: str | None = agent.add_peer(peer.metadata)
        except BaseException:
            self._close_agent()
            raise

    @classmethod
    def probe(cls) -> str | None:
        return nixl_probe("UCX")

    def read(self, reads: ReadBatch, dst: np.ndarray) -> TransferStats:
        source = f"the arena of {self.peer.agent_name}"
        reads = self._checked(reads, dst, self.peer.length, source)
        if self._peer_name is None:
            raise TransportClosedError(f"{self.name} lost its peer; build a new one")
        self._check_reachable(reads)
        reads = split_at(reads, np.array([start for start, _ in self.peer.chunks]))
        remote = descriptors(self.peer.base_address + reads.src_offsets, reads.lengths)
        return self._transfer(self._peer_name, reads, dst, remote, "DRAM")

    def _check_reachable(self, reads: ReadBatch) -> None:
        if self.peer.holds(reads.src_offsets, reads.lengths):
            return
        newer = self._refresh() if self._refresh is not None else None
        if newer is not None and newer.same_export(self.peer):
            assert self._peer_name is not None
            self._live_agent.add_peer(newer.metadata)  # NIXL adds the chunks it names
            self.peer = self.peer.learned(newer)
        if not self.peer.holds(reads.src_offsets, reads.lengths):
            raise ForeignMemoryError("a range outside the arena chunks exported to this tenant")

    def _drop_connection(self) -> None:
        name, self._peer_name = self._peer_name, None
        if name is not None:
            self._live_agent.remove_peer(name)  # closes the UCX endpoint, cancelling its requests

    def close(self) -> None:
        if self._agent is None:
            return
        try:
            self._drop_connection()
        finally:
            self._close_agent()
