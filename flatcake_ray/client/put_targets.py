"""How a client reaches the memory an owner hands out for a put (``PutTarget``).

On the owner's node the client maps the owner's chunk (of its arena, or of its landing area;
sent as a descriptor, ``media/fd_handout.py``) shared and writable, once per chunk, and
copies a layer's pages straight in (mapped again when the chunk's file was retired since:
it changed tenants, ``media/chunk_files.py``). From another node it
WRITEs them over NIXL: the pages are gathered into a region of the client's own staging
memory (registered once) and written with one one-sided WRITE, no owner CPU involved.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from flatcake_ray.actors.protocol import PutMemory, PutTarget
from flatcake_ray.client.staging import StagingArena
from flatcake_ray.cuda_ext.host_copy import copy_into
from flatcake_ray.cuda_ext.host_hash import copy_hashing_source
from flatcake_ray.media.chunk_files import is_retired
from flatcake_ray.media.fd_handout import HandedChunk

MAX_MAPPINGS = 8  # owners' chunks mapped at once
MAX_WRITERS = 16  # owners' exports with a live NIXL connection


def map_shared(fd: int, nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Map ``nbytes`` of the file open as ``fd`` shared and writable (memory the owner
    handed out, on this node), pre-faulted: a put writing a page this process never touched
    would otherwise take a write fault per 4 KiB (shared mappings get no fault-around on
    writes). The caller keeps ``fd``."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mapping = mmap.mmap(fd, nbytes, flags=flags)
    return mapping, np.frombuffer(mapping, dtype=np.uint8)


class PutTargets:
    def __init__(self, staging: StagingArena, timeout_s: float) -> None:
        self.staging = staging
        self.timeout_s = timeout_s
        self._maps: OrderedDict[tuple[Any, ...], _Mapped] = OrderedDict()
        self._writers: OrderedDict[str, Any] = OrderedDict()
        self._agent: Any = None
        self._lock = threading.Lock()

    def mapped(self, link: Any, target: PutTarget) -> np.ndarray:
        """The one chunk ``target`` is in, mapped shared and writable (handed out by its
        node on the first put there)."""
        memory, offset = target.memory.value, target.chunk_offset
        key = (link.description.actor_name, target.owner, memory, offset)
        with self._lock:
            known = self._maps.get(key)
            if known is not None and is_retired(known.fd):
                self._maps.pop(key).close()
                known = None
            if known is None:
                handed = link.hand_chunks(memory, [offset])
                known = self._maps[key] = _map_handed(handed)
                if target.memory is PutMemory.ARENA:  # read back soon, as an engine does
                    link.learn_arena_chunk(handed[0])
            self._maps.move_to_end(key)
            while len(self._maps) > MAX_MAPPINGS:
                self._maps.popitem(last=False)[1].close()
            return known.view

    def premap(self, link: Any, handed: list[HandedChunk]) -> int:
        """Map ``handed`` (chunks of the arena of ``link``'s node, on this machine, handed
        out for this client's tenant) for puts now, as a put's first write into each would:
        a chunk mapped here fills its page tables whole (1.2 GB of 4 KiB pages: 70-140 ms),
        which a client pays at start (``FlatCakeClient.warm_up``), not in a put. Takes the
        descriptors; returns how many chunks were mapped (at most ``MAX_MAPPINGS`` in all)."""
        owner = link.description.owner
        mapped = 0
        rest = list(handed)
        try:
            while rest:
                chunk = rest.pop(0)
                key = (link.description.actor_name, owner, PutMemory.ARENA.value, chunk.offset)
                with self._lock:
                    room = key not in self._maps and len(self._maps) < MAX_MAPPINGS
                if not room:
                    os.close(chunk.fd)
                    continue
                made = _Mapped(chunk)  # outside the lock: the long part
                link.learn_arena_chunk(chunk)
                with self._lock:
                    if key in self._maps:
                        made.close()
                        continue
                    self._maps[key] = made
                    mapped += 1
        finally:
            for chunk in rest:
                os.close(chunk.fd)
        return mapped

    def write(
        self, peer: Any, offset: int, pages: np.ndarray, positions: Any, block_bytes: int
    ) -> np.ndarray | None:
        """WRITE ``pages[positions]`` (all of them when ``positions`` is None) to ``offset``
        of ``peer``'s exported memory; returns when the bytes are there, with the checksums
        of each ``block_bytes`` of what was written when they were taken in the gathering
        copy (all pages: one pass, where copy, then hash took two), else None."""
        count = len(pages) if positions is None else len(positions)
        nbytes = count * pages.shape[1]
        region = self.staging.take(nbytes, self.timeout_s)
        sums = None
        try:
            gathered = region.view[:nbytes].reshape(count, pages.shape[1])
            if positions is not None:
                np.take(pages, positions, axis=0, out=gathered)
            elif (sums := copy_hashing_source(gathered, pages, block_bytes)) is None:
                copy_into(gathered, pages)
            self._writer(peer).write(region.view[:nbytes], offset)
        finally:
            self.staging.give(region)
        return sums

    def _writer(self, peer: Any) -> Any:
        from flatcake_ray.actors.nixl_roles import reader_agent
        from flatcake_ray.transports.nixl_agent import unique_agent_name
        from flatcake_ray.transports.nixl_write import NixlDramWriter

        with self._lock:
            writer = self._writers.get(peer.agent_name)
            if writer is not None and (writer.broken or not writer.peer.same_export(peer)):
                writer.close()  # a failed write, or the owner re-exported (restarted)
                writer = None
            if writer is not None:
                writer.learn(peer)  # the chunk this put's ticket gave (known, or one more)
            if writer is None:
                if self._agent is None:
                    self._agent = reader_agent(unique_agent_name("fc-put"))
                writer = NixlDramWriter(self._agent, peer, timeout_s=self.timeout_s)
                self._writers[peer.agent_name] = writer
            self._writers.move_to_end(peer.agent_name)
            while len(self._writers) > MAX_WRITERS:
                self._writers.popitem(last=False)[1].close()
            return writer

    def close(self) -> None:
        with self._lock:
            for writer in self._writers.values():
                writer.close()
            self._writers.clear()
            for mapped in self._maps.values():
                mapped.close()
            self._maps.clear()
            if self._agent is not None:
                self._agent.close()
                self._agent = None


class _Mapped:
    """A chunk mapped shared, and its descriptor (kept to see the file retired)."""

    def __init__(self, chunk: HandedChunk) -> None:
        self.fd = chunk.fd
        self.mapping, self.view = map_shared(chunk.fd, chunk.nbytes)

    def close(self) -> None:
        os.close(self.fd)  # the mapping goes once its last view does


def _map_handed(handed: list[HandedChunk]) -> _Mapped:
    try:
        (chunk,) = handed
        mapped = _Mapped(chunk)
    except BaseException:
        for chunk in handed:
            os.close(chunk.fd)
        raise
    return mapped
