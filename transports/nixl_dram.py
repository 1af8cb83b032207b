"""Remote DRAM over NIXL (UCX backend): one-sided READs of another node's arena.

Owner (StorageNode): ``NixlArenaExporter(name, arena)`` registers the arena once;
``peer_info()`` is the picklable :class:`NixlPeerInfo` a reader needs, sent in one Ray call.
Reader: ``NixlDramTransport(local_agent, peer_info)`` reads a :class:`ReadBatch` of arena
ranges with one NIXL transfer, one descriptor per range. On RDMA-capable UCX transports the
owner's CPU takes no part; over TCP UCX emulates READ with the owner's progress thread.
Puts go the other way through the same agent code: ``nixl_write.NixlDramWriter`` (WRITE).
The agent itself (registrations, transfers, progress) is ``nixl_agent.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from flatcake_ray.errors import (
    TransferError,
    TransportClosedError,
)
from flatcake_ray.transports.base import (
    REMOTE_DRAM_NIXL,
    ReadBatch,
    TransferStats,
    Transport,
)
from flatcake_ray.transports.nixl_agent import (
    DEFAULT_TIMEOUT_S,
    NixlAgent,
    buffer_address,
    nixl_probe,
)


@dataclass(frozen=True)
class NixlPeerInfo:
    """What a reader needs to reach an exported arena; picklable for a Ray call."""

    agent_name: str
    metadata: bytes
    base_address: int
    length: int


class NixlArenaExporter:
    """Owner side: registers ``buffer`` (the arena) with a NIXL agent for remote READs.

    The buffer must stay alive and unmoved until ``close()``; the exporter keeps a reference.
    Pass ``agent`` to share one agent with this process's readers (it is then not closed).
    """

    def __init__(self, name: str, buffer: np.ndarray, *, agent: NixlAgent | None = None) -> None:
        self._base = buffer_address(buffer)
        self._buffer = buffer
        self._owns_agent = agent is None
        self._agent = agent if agent is not None else NixlAgent(name)
        self._registration = self._agent.register(buffer)

    @property
    def base_address(self) -> int:
        return self._base

    @property
    def length(self) -> int:
        return int(self._buffer.nbytes)

    def metadata(self) -> bytes:
        return self._agent.metadata()

    def peer_info(self) -> NixlPeerInfo:
        return NixlPeerInfo(self._agent.name, self.metadata(), self._base, self.length)

    def close(self) -> None:
        if self._registration is None:
            return
        registration, self._registration = self._registration, None
        try:
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
    """

    name = REMOTE_DRAM_NIXL

    def __init__(
        self,
        local_agent: str | NixlAgent,
        peer: NixlPeerInfo,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_registrations: int = 8,
    ) -> None:
        if isinstance(local_agent, str):
            agent, owns = NixlAgent(local_agent, max_registrations=max_registrations), True
        else:
            agent, owns = local_agent, False
        super().__init__(agent, owns, timeout_s)
        self.peer = peer
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
        remote = descriptors(self.peer.base_address + reads.src_offsets, reads.lengths)
        if self._peer_name is None:
            raise TransportClosedError(f"{self.name} lost its peer; build a new one")
        return self._transfer(self._peer_name, reads, dst, remote, "DRAM")

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
