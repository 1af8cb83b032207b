"""Node memory that clients write a put's SSD layers into, handed out by the node.

A put whose segment goes to SSD gets two slots of one layer stride each (double buffering):
the client writes layer ``n`` into slot ``n % 2`` (mapped, on this node; one NIXL WRITE,
from another) and calls ``land``; the node checksums the slot and writes it to its drive
with one O_DIRECT command straight from it. The node names the memory, never the caller, so
a put's bytes can only come from memory the node handed out (``docs/security.md``). Slots go
back when the put commits, aborts or expires (``PutHandle.on_done``).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from flatcake_ray.actors.shipping import RegionAllocator
from flatcake_ray.errors import ShipBufferFullError
from flatcake_ray.media.arena import DramArena


class LandingArea:
    def __init__(self, nbytes: int, name: str) -> None:
        # Shared memory a client of this node maps by path: no huge pages needed (one put's
        # slots are rewritten per layer, never held).
        self.memory = DramArena(nbytes, name, hugepages="off")
        # Slots are freed by their put's end, which the put table expires: no TTL here.
        self._regions = RegionAllocator(nbytes, math.inf)
        self._lock = threading.Lock()
        self._exporter: Any = None
        self.peer: Any = None  # NixlPeerInfo once exported

    @property
    def path(self) -> str:
        return self.memory.path

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes

    def export(self, agent: Any) -> None:
        from flatcake_ray.transports.nixl_dram import NixlArenaExporter

        self._exporter = NixlArenaExporter(agent.name, self.memory.view, agent=agent)
        self.peer = self._exporter.peer_info()

    def take(self, nbytes: int, owner: str) -> tuple[int, int] | None:
        """(region id, offset) of ``nbytes`` for ``owner``; None when the area is full."""
        with self._lock:
            try:
                return self._regions.allocate(nbytes, owner)
            except ShipBufferFullError:
                return None

    def give(self, region_id: int, owner: str) -> None:
        with self._lock:
            self._regions.free(region_id, owner)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.memory.view[offset : offset + nbytes]

    def close(self) -> None:
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None
        self.memory.close()
