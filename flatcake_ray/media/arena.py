"""The DRAM arena of a node: anonymous shared-memory files (its chunks, memfds) that local
readers map read-only.

Addressed by arena offsets (the GVA's Offset field of a DRAM page). Knows nothing of keys or
scopes; the catalog decides where bytes go, and, with more than one chunk, which tenant's
pages each chunk holds (``core/extents.py``). A chunk has no path: no other process can open
it by name, only map a descriptor the node sends it (``media/fd_handout.py``), and the node
sends a tenant's client its own tenant's chunks only (``StorageNode.hand_chunks``). The
owner maps every chunk side by side (``media/chunk_map.py``), so its view of the arena is one
array. A memfd goes with the last process that holds it: a node that dies leaves nothing
behind to clean up. A chunk that changes hands gets a fresh memfd (:meth:`DramArena.renew_chunk`,
``media/chunk_files.py``): what the former tenant's client mapped is not the next tenant's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flatcake_ray.cuda_ext.host_copy import copy_into
from flatcake_ray.errors import ConfigError, MediumFullError
from flatcake_ray.media import cuda_host
from flatcake_ray.media.chunk_files import new_chunk_file, retire
from flatcake_ray.media.chunk_map import HUGE_PAGE, ChunkMap
from flatcake_ray.media.log import log_once


def _free_huge_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("HugePages_Free:"):
                return int(line.split()[1]) * HUGE_PAGE
    except OSError:
        return 0
    return 0


@dataclass(frozen=True)
class ArenaChunk:
    """One chunk of a node's arena as a client knows it: where it sits in the arena's
    offsets and how long it is (its descriptor comes apart, ``media/fd_handout.py``)."""

    offset: int
    nbytes: int


class DramArena:
    """One shared-memory arena per node, in ``nbytes / chunk_bytes`` chunk memfds (one when
    ``chunk_bytes`` is 0); other processes of the node map the chunks they are sent.

    Backed by hugetlb memfds (2 MiB pages) when enough huge pages are reserved and a chunk is
    a whole number of them, else by plain memfds (logged once). Allocated when made
    (``posix_fallocate``) and mapped with MAP_POPULATE, so no copy takes a page fault, and
    registered with cudaHostRegister when CUDA exists so copies to the GPU are DMA.
    """

    def __init__(
        self, nbytes: int, name: str, hugepages: str = "auto", chunk_bytes: int = 0
    ) -> None:
        self.nbytes = nbytes
        self.name = name
        self.chunk_bytes = chunk_bytes or nbytes
        self.huge = self._choose_pages(nbytes, hugepages)
        self._map = ChunkMap(self._mapped_bytes(nbytes)) if nbytes else None
        self.chunk_fds: list[int] = []
        count = -(-nbytes // self.chunk_bytes) if nbytes else 0
        try:
            for index in range(count):
                self._make_chunk(index)
        except BaseException:
            self._close_fds()
            raise
        self.view = (
            self._map.view[:nbytes] if self._map is not None else np.zeros(0, dtype=np.uint8)
        )
        self._cuda_chunks: set[int] = set()  # chunks registered with cudaHostRegister
        self.renewals = 0
        self._renewing = threading.Lock()  # one renewal at a time (the registrations change)
        # Told the offset of each chunk renewed: exports that registered it (a storage node's).
        self.on_renewed: list[Callable[[int], None]] = []
        self.register_with_cuda()

    @property
    def cuda_registered(self) -> bool:
        return bool(self._cuda_chunks)

    @property
    def chunks(self) -> int:
        return len(self.chunk_fds)

    def chunk_span(self, index: int) -> tuple[int, int]:
        """(arena offset, bytes) of chunk ``index``."""
        start = index * self.chunk_bytes
        return start, min(self.chunk_bytes, self.nbytes - start)

    def chunk(self, index: int) -> ArenaChunk:
        return ArenaChunk(*self.chunk_span(index))

    def chunk_fd(self, offset: int) -> int:
        """The descriptor of the chunk that starts at arena offset ``offset``."""
        return self.chunk_fds[offset // self.chunk_bytes]

    def _make_chunk(self, index: int) -> None:
        start, nbytes = self.chunk_span(index)
        size = self._mapped_bytes(nbytes)
        fd = new_chunk_file(f"flatcake-{self.name}-{index}", size, huge=self.huge)
        self.chunk_fds.append(fd)
        assert self._map is not None
        # Allocated now, not at first touch: a client's first write into memory no one had
        # allocated ran at 0.55x its later writes (224 MB: 20-22 ms against 12), so a put
        # into memory not written since the node started paid it (every put of a fresh
        # node). ``ChunkMap.place`` faults every page in for writing through the owner's
        # mapping, after asking for huge pages.
        self._map.place(start, fd, size, shared=True)

    def renew_chunk(self, index: int) -> None:
        """Give chunk ``index`` a fresh memfd in place of its own, which is retired (its pages
        freed, ``media/chunk_files.py``): the chunk goes to another tenant, and a process that
        mapped it before (the former tenant's client) must reach nothing written there now.

        The owner's view keeps its addresses (the new file is mapped over the old at the same
        place) and never maps a retired file; the old pages are freed before the new ones are
        allocated, so a renewal needs no memory beyond the chunk. It runs under the store's
        lock as the new tenant's put takes the chunk, or ahead of time off that lock for a
        chunk left empty (``core/extents.py`` ``hand_over_vacated``); renewals of one arena
        run one at a time (``benchmarks/chunk_renewal.py`` times one). Whatever the chunk
        held is gone: call it only for an empty chunk. No memory for the fresh file is
        :class:`MediumFullError`."""
        with self._renewing:
            try:
                self._renew(index)
            except OSError as error:  # no memory for the fresh file: not handed over
                raise MediumFullError(f"a fresh file for DRAM chunk {index}: {error}") from error
            self.renewals += 1
            for renewed in self.on_renewed:
                renewed(index * self.chunk_bytes)

    def _renew(self, index: int) -> None:
        assert self._map is not None
        start, nbytes = self.chunk_span(index)
        size = self._mapped_bytes(nbytes)
        fd = new_chunk_file(f"flatcake-{self.name}-{index}", size, huge=self.huge)
        registered = index in self._cuda_chunks
        try:
            self._unregister_chunk(index)
            self._map.place(start, fd, size, shared=True, populate=False)
        except BaseException:
            os.close(fd)
            raise
        old, self.chunk_fds[index] = self.chunk_fds[index], fd
        try:
            retire(old)
        finally:
            os.close(old)
        # Allocated, as a new chunk is (a client's first writes would fault in every page),
        # but not pre-faulted in the owner's own mapping: that would take as long again,
        # under the store's lock, for reads that fault around 16 pages at a time anyway.
        # (So where huge pages come only to a mapping that asks, ``shmem_enabled = advise``,
        # a renewed chunk's pages are 4 KiB: renewals are rare, the lock is not.)
        os.posix_fallocate(fd, 0, size)
        if registered:
            self._register_chunk(index)

    def _mapped_bytes(self, nbytes: int) -> int:
        return -(-nbytes // HUGE_PAGE) * HUGE_PAGE if self.huge else nbytes

    def _choose_pages(self, nbytes: int, hugepages: str) -> bool:
        """Whether the chunks are hugetlb memfds."""
        enough = _free_huge_bytes() >= -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        whole = self.chunk_bytes % HUGE_PAGE == 0
        if hugepages != "off" and enough and whole and nbytes:
            return True
        if hugepages == "require":
            raise ConfigError(
                "hugepages=require but not enough 2 MiB huge pages are reserved, "
                "or a DRAM chunk is not a whole number of them"
            )
        if hugepages == "auto":
            log_once("hugepages", "DRAM arena: no reserved 2 MiB huge pages; using 4 KiB pages")
        return False

    def register_with_cuda(self) -> None:
        """Register every chunk (one registration each, so one can be renewed alone), or
        none where one fails (copies to a GPU are then staged by CUDA, slower). Done as the
        arena is made in a process that has loaded torch, else when its store's first
        restore into a GPU asks (a storage node, which loads no torch, never does); once."""
        with self._renewing:
            if self._cuda_chunks or cuda_host.cudart() is None:
                return
            for index in range(self.chunks):
                if not self._register_chunk(index):
                    for registered in list(self._cuda_chunks):
                        self._unregister_chunk(registered)
                    return

    def _chunk_view(self, index: int) -> np.ndarray:
        start, nbytes = self.chunk_span(index)
        return self.view[start : start + nbytes]

    def _register_chunk(self, index: int) -> bool:
        if not cuda_host.register(self._chunk_view(index), "a DRAM arena chunk"):
            return False
        self._cuda_chunks.add(index)
        return True

    def _unregister_chunk(self, index: int) -> None:
        if index in self._cuda_chunks:
            self._cuda_chunks.discard(index)
            cuda_host.unregister(self._chunk_view(index))

    def write(self, offset: int, data: np.ndarray) -> None:
        flat = data.reshape(-1).view(np.uint8)
        copy_into(self.view[offset : offset + flat.size], flat)

    def close(self) -> None:
        for index in list(self._cuda_chunks):
            self._unregister_chunk(index)
        self.view = np.zeros(0, dtype=np.uint8)
        # A view still alive elsewhere (a traceback's frame, a caller's slice) keeps the
        # mapping until it goes (the chunk map unmaps when its last view does); the memory
        # goes with the last mapping and descriptor.
        self._map = None
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in self.chunk_fds:
            os.close(fd)
        self.chunk_fds = []
