"""The DRAM arena of a node: shared-memory files (its chunks) that local readers map read-only.

Addressed by arena offsets (the GVA's Offset field of a DRAM page). Knows nothing of keys or
scopes; the catalog decides where bytes go, and, with more than one chunk, which tenant's
pages each chunk holds (``core/extents.py``): a client is handed only its own tenant's chunk
files (``StorageNode.describe``, put tickets). The owner maps every chunk side by side
(``media/chunk_map.py``), so its view of the arena is one array.
"""

from __future__ import annotations

import mmap
import os
import secrets
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


def _remove_stale_arenas(folder: Path, prefix: str) -> None:
    """Unlink arenas of this node left by processes that died without closing them."""
    for path in folder.glob(prefix + "*"):
        owner = path.name[len(prefix) :].split("-")[0]  # <pid> or <pid>-<chunk>-<token>
        if owner.isdigit() and not _process_alive(int(owner)):
            path.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class ArenaChunk:
    """One chunk of a node's arena as handed to a client: where it sits in the arena's
    offsets, how long it is, and its file."""

    offset: int
    nbytes: int
    path: str


class DramArena:
    """One shared-memory arena per node, in ``nbytes / chunk_bytes`` chunk files (one file
    when ``chunk_bytes`` is 0); other processes of the node map chunks read-only.

    Backed by files on hugetlbfs (2 MiB pages) when enough huge pages are reserved and a
    chunk is a whole number of them, else by files in /dev/shm (logged once). Pre-faulted
    with MAP_POPULATE so no copy takes a page fault, and registered with cudaHostRegister
    when CUDA exists so copies to the GPU are DMA. A chunk file's name carries a random
    token (a client that was not handed it has to list the folder to find it).
    """

    def __init__(
        self, nbytes: int, name: str, hugepages: str = "auto", chunk_bytes: int = 0
    ) -> None:
        self.nbytes = nbytes
        self.chunk_bytes = chunk_bytes or nbytes
        self.huge = False
        folder = self._choose_folder(name, nbytes, hugepages)
        align = HUGE_PAGE if self.huge else mmap.PAGESIZE
        self._map = ChunkMap(self._mapped_bytes(nbytes), align) if nbytes else None
        self.chunk_paths: list[str] = []
        count = -(-nbytes // self.chunk_bytes) if nbytes else 0
        try:
            for index in range(count):
                self._make_chunk(folder, name, index, count)
        except BaseException:
            self._unlink_chunks()
            raise
        self.view = (
            self._map.view[:nbytes] if self._map is not None else np.zeros(0, dtype=np.uint8)
        )
        self.cuda_registered = self._register_with_cuda()

    @property
    def path(self) -> str:
        """The file of the first chunk (the whole arena when it is one chunk)."""
        return self.chunk_paths[0] if self.chunk_paths else ""

    def chunk_span(self, index: int) -> tuple[int, int]:
        """(arena offset, bytes) of chunk ``index``."""
        start = index * self.chunk_bytes
        return start, min(self.chunk_bytes, self.nbytes - start)

    def chunk(self, index: int) -> ArenaChunk:
        return ArenaChunk(*self.chunk_span(index), self.chunk_paths[index])

    def _make_chunk(self, folder: Path, name: str, index: int, count: int) -> None:
        # A per-process name: a restarted node never truncates a file that a client of the
        # previous one may still have mapped (that client would take SIGBUS, not a miss).
        stem = f"flatcake-{name}-{os.getpid()}"
        path = folder / (stem if count == 1 else f"{stem}-{index}-{secrets.token_hex(8)}")
        start, nbytes = self.chunk_span(index)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.chunk_paths.append(str(path))
        try:
            os.ftruncate(fd, self._mapped_bytes(nbytes))
        finally:
            os.close(fd)
        assert self._map is not None
        self._map.place(start, str(path), self._mapped_bytes(nbytes), shared=True)

    def _mapped_bytes(self, nbytes: int) -> int:
        return -(-nbytes // HUGE_PAGE) * HUGE_PAGE if self.huge else nbytes

    def _choose_folder(self, name: str, nbytes: int, hugepages: str) -> Path:
        hugetlbfs = Path("/dev/hugepages")
        enough = _free_huge_bytes() >= -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        whole = self.chunk_bytes % HUGE_PAGE == 0
        if hugepages != "off" and hugetlbfs.is_dir() and enough and whole and nbytes:
            self.huge = True
            folder = hugetlbfs
        elif hugepages == "require":
            raise ConfigError(
                "hugepages=require but not enough 2 MiB huge pages are reserved, "
                "or a DRAM chunk is not a whole number of them"
            )
        else:
            if hugepages == "auto":
                log_once("hugepages", "DRAM arena: no reserved 2 MiB huge pages; using 4 KiB pages")
            folder = Path("/dev/shm")
        _remove_stale_arenas(folder, f"flatcake-{name}-")
        return folder

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
        # mapping until it goes (the chunk map unmaps when its last view does).
        self._map = None
        self._unlink_chunks()

    def _unlink_chunks(self) -> None:
        for path in self.chunk_paths:
            Path(path).unlink(missing_ok=True)

    @staticmethod
    def attach(path: str, nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
        """Map another process's arena for reading (the local-DRAM read path of a client).

        The file is opened read-only and mapped private: this process can never change the
        shared arena (a write would only copy a page into its own memory), while Linux maps
        the owner's pages in place until then, so every read sees the owner's bytes. The view
        is nominally writable only because torch refuses read-only numpy arrays. (The arena
        is pre-faulted by its owner, so no page of it is a hole a private mapping would see
        as zeros.)"""
        fd = os.open(path, os.O_RDONLY)
        try:
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=prot)
        finally:
            os.close(fd)
        return mapping, np.frombuffer(mapping, dtype=np.uint8)
