"""Puts into another node's memory over NIXL: one-sided WRITE, no owner CPU.

The storage node exports its arena (DRAM puts land in place) and its landing area (SSD
layers, which the node then writes to its drive); see ``actors/landing.py``.
"""

from __future__ import annotations

import time

import numpy as np

from flatcake_ray.errors import (
    ForeignMemoryError,
    ReadRangeError,
    TransferError,
    TransportClosedError,
)
from flatcake_ray.transports.base import (
    REMOTE_DRAM_NIXL,
    TransferStats,
    check_destination_buffer,
)
from flatcake_ray.transports.nixl_agent import DEFAULT_TIMEOUT_S, NixlAgent
from flatcake_ray.transports.nixl_dram import NixlPeerInfo, descriptors


class NixlDramWriter:
    """Writer side of a put into another node's memory over NIXL (one-sided WRITE, no owner
    CPU): ``peer`` is what the owner exported (its arena, or its landing area for SSD
    layers). Offsets are into that memory. Sources are registered on first use and cached
    (see :class:`RegistrationCache`): write from one staging buffer, or slices of it.

    Who calls: the Ray client's put (``flatcake_ray.client.put``), one writer per owner, one
    write at a time; ``close()`` when the owner goes away. A failed write breaks the writer
    (build a new one), as a failed read does a reader.
    """

    name = REMOTE_DRAM_NIXL

    def __init__(
        self, agent: NixlAgent, peer: NixlPeerInfo, *, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self._agent: NixlAgent | None = agent
        self.peer = peer
        self._timeout_s = timeout_s
        self._peer_name: str | None = agent.add_peer(peer.metadata)

    @property
    def broken(self) -> bool:
        return self._peer_name is None

    def learn(self, peer: NixlPeerInfo) -> None:
        """Reach ``peer``'s chunks too (another chunk of the same export, handed out since)."""
        if self._agent is None or self._peer_name is None:
            raise TransportClosedError(f"the NIXL writer to {self.peer.agent_name} is closed")
        if not set(peer.chunks) <= set(self.peer.chunks):
            self._agent.add_peer(peer.metadata)  # NIXL adds the chunks it names
            self.peer = self.peer.learned(peer)

    def write(self, src: np.ndarray, offset: int) -> TransferStats:
        """Copy all of ``src`` (1-D uint8, C-contiguous) to ``offset`` of the peer's memory,
        inside one chunk the writer was given."""
        if self._agent is None or self._peer_name is None:
            raise TransportClosedError(f"the NIXL writer to {self.peer.agent_name} is closed")
        check_destination_buffer(src)
        if offset < 0 or offset + src.nbytes > self.peer.length:
            raise ReadRangeError(
                f"[{offset}, +{src.nbytes}) lies outside the {self.peer.length} exported bytes"
            )
        if not self.peer.holds(np.array([offset]), np.array([src.nbytes])):
            raise ForeignMemoryError(f"[{offset}, +{src.nbytes}) lies outside the chunks given")
        start = time.perf_counter()
        local = descriptors(np.array([src.ctypes.data]), np.array([src.nbytes]))
        remote = descriptors(np.array([self.peer.base_address + offset]), local[:, 1])
        with self._agent.destinations.use(src):
            try:
                self._agent.write(
                    self._peer_name, local, remote, timeout_s=self._timeout_s, src=src
                )
            except TransferError:
                self.close()
                raise
        return TransferStats(src.nbytes, 1, time.perf_counter() - start, self.name)

    def close(self) -> None:
        name, self._peer_name = self._peer_name, None
        if name is not None and self._agent is not None:
            self._agent.remove_peer(name)
        self._agent = None
