"""The DRAM arena of a node: anonymous shared-memory files (its chunks, memfds) that local
readers map read-only.

Addressed by arena offsets (the GVA's Offset field of a DRAM page). Knows nothing of keys or
scopes; the catalog decides where bytes go, and, with more than one chunk, which tenant's
pages each chunk holds (``core/extents.py``). A chunk has no path: no other process can open
it by name, only map a descriptor the node sends it (``media/fd_handout.py``), and the node
sends a tenant's client its own tenant's chunks only (``StorageNode.hand_chunks``). The
owner maps every chunk side by side (``media/chunk_map.py``), so its view of the arena is one
array. A memfd goes with the last process that holds it: a node that dies leaves nothing
behind to clean up.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flatcake_ray.cuda_ext.host_copy import copy_into
from flatcake_ray.errors import ConfigError
from flatcake_ray.media.chunk_map import ChunkMap
from flatcake_ray.media.log import log_once

HUGE_PAGE = 2 << 20


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
        self.chunk_bytes = chunk_bytes or nbytes
        self.huge = self._choose_pages(nbytes, hugepages)
        align = HUGE_PAGE if self.huge else mmap.PAGESIZE
        self._map = ChunkMap(self._mapped_bytes(nbytes), align) if nbytes else None
        self.chunk_fds: list[int] = []
        count = -(-nbytes // self.chunk_bytes) if nbytes else 0
        try:
            for index in range(count):
                self._make_chunk(name, index)
        except BaseException:
            self._close_fds()
            raise
        self.view = (
            self._map.view[:nbytes] if self._map is not None else np.zeros(0, dtype=np.uint8)
        )
        self.cuda_registered = self._register_with_cuda()

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

    def _make_chunk(self, name: str, index: int) -> None:
        flags = os.MFD_CLOEXEC | (os.MFD_HUGETLB if self.huge else 0)
        fd = os.memfd_create(f"flatcake-{name}-{index}", flags)
        self.chunk_fds.append(fd)
        start, nbytes = self.chunk_span(index)
        os.ftruncate(fd, self._mapped_bytes(nbytes))
        # Allocated now, not at first touch: with only MAP_POPULATE (here and in a client's
        # mapping), a client's first write into a chunk ran at 0.55x its later writes
        # (224 MB: 20-22 ms against 12), so a put into memory not written since the node
        # started paid it (every put of a fresh node).
        os.posix_fallocate(fd, 0, self._mapped_bytes(nbytes))
        assert self._map is not None
        self._map.place(start, fd, self._mapped_bytes(nbytes), shared=True)

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

    def _register_with_cuda(self) -> bool:
        import sys

        torch = sys.modules.get("torch")  # never import CUDA just for this
        if torch is None or not self.nbytes or not torch.cuda.is_available():
            return False
        result = torch.cuda.cudart().cudaHostRegister(self.view.ctypes.data, self.nbytes, 0)
        if int(result) != 0:
            log_once("cudareg", "cudaHostRegister of the DRAM arena failed: %s", result)
            return False
        return True

    def write(self, offset: int, data: np.ndarray) -> None:
        flat = data.reshape(-1).view(np.uint8)
        copy_into(self.view[offset : offset + flat.size], flat)

    def close(self) -> None:
        if self.cuda_registered:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.view.ctypes.data)
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
