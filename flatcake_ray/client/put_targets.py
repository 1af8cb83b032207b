"""How a client reaches the memory an owner hands out for a put (``PutTarget``).

On the owner's node the client maps the owner's file (its arena, or its landing area) shared
and writable, once per file, and copies a layer's pages straight in. From another node it
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

from flatcake_ray.client.staging import StagingArena
from flatcake_ray.cuda_ext.host_copy import copy_into

MAX_MAPPINGS = 8  # owners' files mapped at once (a node restart makes a new file)
MAX_WRITERS = 16  # owners' exports with a live NIXL connection


def map_shared(path: str, nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Map ``path`` shared and writable (a file the owner handed out, on this node),
    pre-faulted: a put writing a page this process never touched would otherwise take a
    write fault per 4 KiB (shared mappings get no fault-around on writes)."""
    fd = os.open(path, os.O_RDWR)
    try:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fd, nbytes, flags=flags)
    finally:
        os.close(fd)
    return mapping, np.frombuffer(mapping, dtype=np.uint8)


class PutTargets:
    def __init__(self, staging: StagingArena, timeout_s: float) -> None:
        self.staging = staging
        self.timeout_s = timeout_s
        self._maps: OrderedDict[str, tuple[mmap.mmap, np.ndarray]] = OrderedDict()
        self._writers: OrderedDict[str, Any] = OrderedDict()
        self._agent: Any = None
        self._lock = threading.Lock()

    def mapped(self, path: str, nbytes: int) -> np.ndarray:
        with self._lock:
            known = self._maps.get(path)
            if known is None:
                known = self._maps[path] = map_shared(path, nbytes)
            self._maps.move_to_end(path)
            while len(self._maps) > MAX_MAPPINGS:
                self._maps.popitem(last=False)  # unmapped once its last view goes
            return known[1]

    def write(self, peer: Any, offset: int, pages: np.ndarray, positions: Any) -> None:
        """WRITE ``pages[positions]`` (all of them when ``positions`` is None) to ``offset``
        of ``peer``'s exported memory; returns when the bytes are there."""
        count = len(pages) if positions is None else len(positions)
        nbytes = count * pages.shape[1]
        region = self.staging.take(nbytes, self.timeout_s)
        try:
            gathered = region.view[:nbytes].reshape(count, pages.shape[1])
            if positions is None:
                copy_into(gathered, pages)
            else:
                np.take(pages, positions, axis=0, out=gathered)
            self._writer(peer).write(region.view[:nbytes], offset)
        finally:
            self.staging.give(region)

    def _writer(self, peer: Any) -> Any:
        from flatcake_ray.actors.nixl_roles import reader_agent
        from flatcake_ray.transports.nixl_agent import unique_agent_name
        from flatcake_ray.transports.nixl_write import NixlDramWriter

        with self._lock:
            writer = self._writers.get(peer.agent_name)
            if writer is not None and (writer.broken or writer.peer != peer):
                writer.close()  # a failed write, or the owner re-exported (restarted)
                writer = None
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
            self._maps.clear()
            if self._agent is not None:
                self._agent.close()
                self._agent = None
