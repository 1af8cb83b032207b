"""What a storage node exports for one-sided access: its arena, ship buffer and landing area
over NIXL (one agent, one progress thread; peers READ the first two and WRITE puts into the
arena and the landing area), and its arena as RDMA memory regions. The arena and the
landing area are registered a chunk at a time, and a tenant is given the NIXL metadata of
its own chunks only (:meth:`NodeExports.arena_peer`, ``LandingArea.peer_of``): its NIXL
refuses any other address of the node. The RDMA export likewise: a memory region per arena
chunk, a reader given the keys of its tenant's (:meth:`NodeExports.accept_rdma`). Each export is
optional: NIXL or RDMA missing, or a node with no DRAM, leaves it out and says why (readers
and writers then take another path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flatcake_ray.actors.landing import LandingArea
from flatcake_ray.actors.shipping import ShipBuffer
from flatcake_ray.errors import ServiceError
from flatcake_ray.media.arena import ArenaChunk, DramArena


class NodeExports:
    def __init__(
        self,
        node_id: int,
        arena: DramArena,
        ship_buffer: ShipBuffer,
        landing: LandingArea,
        busy: Callable[[], bool] | None = None,
    ) -> None:
        """``busy``: whether peers hold this node's memory now (its agent's pump polls at
        full rate while they do: ``actors/nixl_roles.py``)."""
        self._arena_exporter: Any = None
        self._agent: Any = None
        self._busy = busy
        self.ship_peer: Any = None
        self.nixl_reason = self._export_nixl(f"fc{node_id}", arena, ship_buffer, landing)
        self._rdma = self._export_rdma(arena)

    def _export_nixl(
        self, tag: str, arena: DramArena, ship_buffer: ShipBuffer, landing: LandingArea
    ) -> str | None:
        from flatcake_ray.actors.nixl_roles import exporter_agent
        from flatcake_ray.transports.nixl_agent import unique_agent_name
        from flatcake_ray.transports.nixl_dram import NixlArenaExporter, NixlDramTransport

        reason = NixlDramTransport.probe()
        if reason is not None:
            return reason
        self._agent = exporter_agent(unique_agent_name(f"{tag}-export"), self._busy)
        if arena.nbytes:  # a node may run SSD-only
            self._arena_exporter = NixlArenaExporter(
                tag, arena.view, agent=self._agent, chunk_bytes=arena.chunk_bytes
            )
        self.ship_peer = ship_buffer.export(self._agent)
        landing.export(self._agent)
        return None

    def arena_peer(self, chunks: Iterable[ArenaChunk]) -> Any:
        """The NixlPeerInfo of these arena chunks alone (None: the arena is not exported)."""
        if self._arena_exporter is None:
            return None
        return self._arena_exporter.peer_info([chunk.offset for chunk in chunks])

    def renew_arena_chunk(self, offset: int) -> None:
        """The arena chunk at ``offset`` has a fresh file: register it again where a
        registration pins pages (``DramArena.renew_chunk``)."""
        if self._arena_exporter is not None:
            self._arena_exporter.renew(offset)
        if self._rdma is not None:
            self._rdma.renew(offset)

    @staticmethod
    def _export_rdma(arena: DramArena) -> Any:
        from flatcake_ray.transports.rdma_export import RdmaArenaExporter
        from flatcake_ray.transports.rdma_port import rdma_probe

        if rdma_probe() is not None or not arena.nbytes:
            return None
        return RdmaArenaExporter(arena.view, chunk_bytes=arena.chunk_bytes)

    @property
    def rdma(self) -> bool:
        return self._rdma is not None

    def accept_rdma(self, reader: Any, chunks: Iterable[ArenaChunk]) -> Any:
        """Connect ``reader`` to the arena, given the keys of ``chunks`` (its tenant's) only."""
        if self._rdma is None:
            raise ServiceError("this node exports no RDMA memory region")
        return self._rdma.accept(reader, [chunk.offset for chunk in chunks])

    def rdma_regions(self, chunks: Iterable[ArenaChunk]) -> tuple[Any, ...]:
        """The RDMA regions (keys) of ``chunks`` alone; none without an RDMA export."""
        if self._rdma is None:
            return ()
        return self._rdma.regions([chunk.offset for chunk in chunks])

    def wake(self) -> None:
        """Peers are about to READ or WRITE this node's memory."""
        if self._agent is not None:
            self._agent.wake()

    def close(self) -> None:
        """Drop the exports (before the memory they export goes)."""
        if self._rdma is not None:
            self._rdma.close()
            self._rdma = None
        if self._arena_exporter is not None:
            self._arena_exporter.close()
            self._arena_exporter = None

    def close_agent(self) -> None:
        """The agent goes last: after the ship buffer's export it also serves."""
        if self._agent is not None:
            self._agent.close()
            self._agent = None
