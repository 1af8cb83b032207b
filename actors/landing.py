"""Node memory that clients write a put's SSD layers into, handed out by the node.

A put whose segment goes to SSD gets two slots of one layer stride each (double buffering):
the client writes layer ``n`` into slot ``n % 2`` (mapped, on this node; one NIXL WRITE,
from another) and calls ``land``; the node checksums the slot and writes it to its drive
with one O_DIRECT command straight from it. The node names the memory, never the caller, so
a put's bytes can only come from memory the node handed out (``docs/security.md``). Slots go
back when the put commits, aborts or expires (``PutHandle.on_done``).

Like the arena, the area is ``chunks`` memfds, each holding one tenant's slots at a time (the
owned allocation of ``core/extents.py``): a put's ticket names only the chunk its slots are
in, its own tenant's, and the node sends a client only its tenant's chunks
(``actors/memory_handout.py``); a chunk with no slot left taken is free for any tenant again,
and one that goes to another tenant gets a fresh file first (``media/chunk_files.py``).
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

import numpy as np

from flatcake_ray.core.extents import MediumSpace, ScopeRuns, hand_over_vacated
from flatcake_ray.media.arena import ArenaChunk, DramArena


class LandingArea:
    def __init__(self, nbytes: int, name: str, chunks: int = 1, *, hugepages: bool = False) -> None:
        # Shared memory a client of this node maps from the descriptor it is sent. The node
        # writes each landed layer to its drive straight from it, and an O_DIRECT write from
        # 4 KiB pages runs at a third of one from 2 MiB pages (2.61 against 7.06 GB/s here):
        # ``hugepages`` takes reserved ones where there are enough left after the arena.
        chunk = -(-nbytes // chunks // 4096) * 4096 if chunks > 1 else nbytes
        pages = "auto" if hugepages else "off"
        self.memory = DramArena(nbytes, name, hugepages=pages, chunk_bytes=chunk)
        count = self.memory.chunks
        # Slots are freed by their put's end, which the put table expires: no TTL here.
        self._space = MediumSpace(chunk, count, 4096, total=nbytes, owned=count > 1)
        self._space.on_handover = self.memory.renew_chunk
        self._held: dict[int, ScopeRuns] = {}  # random ids: only their owner gives them back
        self._lock = threading.Lock()
        self._exporter: Any = None

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes

    def export(self, agent: Any) -> None:
        from flatcake_ray.transports.nixl_dram import NixlArenaExporter

        self._exporter = NixlArenaExporter(
            agent.name, self.memory.view, agent=agent, chunk_bytes=self.memory.chunk_bytes
        )
        self.memory.on_renewed.append(self._exporter.renew)  # registered anew with its file

    def peer_of(self, chunk: ArenaChunk) -> Any:
        """The NixlPeerInfo of this chunk alone (None: the area is not exported)."""
        return None if self._exporter is None else self._exporter.peer_info([chunk.offset])

    def take(self, nbytes: int, owner: str) -> tuple[int, int] | None:
        """(region id, offset) of ``nbytes`` for ``owner``, in a chunk it holds or takes;
        None when none has room."""
        runs = ScopeRuns(owner=owner)
        with self._lock:
            offset = self._space.place(runs, nbytes, reserve_ahead=False)
            if offset is None:
                return None
            region_id = secrets.randbits(63)
            self._held[region_id] = runs
            return region_id, offset

    def give(self, region_id: int, owner: str) -> None:
        """Give back ``owner``'s slots (anyone else's stay taken)."""
        with self._lock:
            runs = self._held.get(region_id)
            if runs is not None and runs.owner == owner:
                del self._held[region_id]
                self._space.release(runs)

    def forget(self, owner: str) -> None:
        """``owner`` was removed: a chunk it held last changes hands whoever takes it next."""
        with self._lock:
            self._space.forget(owner)

    def hand_over_vacated(self) -> int:
        """Give every chunk its tenant left empty a fresh file now, off the area's lock."""
        return hand_over_vacated(self._space, self._lock, self.memory.renew_chunk)

    def chunk_at(self, offset: int) -> ArenaChunk:
        """The chunk that holds ``offset`` (what a put's ticket names)."""
        return self.memory.chunk(offset // self.memory.chunk_bytes)

    def chunks_of(self, owner: str) -> tuple[ArenaChunk, ...]:
        """The chunks ``owner`` holds slots in now (every chunk of an area of one)."""
        with self._lock:
            return tuple(self.memory.chunk(region) for region in self._space.regions_of(owner))

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.memory.view[offset : offset + nbytes]

    def close(self) -> None:
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None
        self.memory.close()
