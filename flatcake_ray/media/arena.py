"""The DRAM arena of a node: one shared-memory file that local readers map read-only.

Addressed by arena offsets (the GVA's Offset field of a DRAM page). Knows nothing of keys or
scopes; the catalog decides where bytes go.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from flatcake_ray.cuda_ext.host_copy import copy_into
from flatcake_ray.errors import ConfigError
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
        owner = path.name[len(prefix) :]
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


class DramArena:
    """One shared-memory arena per node; other processes of the node map it read-only.

    Backed by a file on hugetlbfs (2 MiB pages) when enough huge pages are reserved, else by
    a file in /dev/shm (logged once). Pre-faulted with MAP_POPULATE so no copy takes a page
    fault, and registered with cudaHostRegister when CUDA exists so copies to the GPU are DMA.
    """

    def __init__(self, nbytes: int, name: str, hugepages: str = "auto") -> None:
        self.nbytes = nbytes
        self.huge = False
        path = self._choose_path(name, nbytes, hugepages)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, self._mapped_bytes(nbytes))
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, self._mapped_bytes(nbytes), flags=flags) if nbytes else None
        finally:
            os.close(fd)
        self.path = str(path)
        self.view = (
            np.frombuffer(self._map, dtype=np.uint8)[:nbytes]
            if self._map is not None
            else np.zeros(0, dtype=np.uint8)
        )
        self.cuda_registered = self._register_with_cuda()

    def _mapped_bytes(self, nbytes: int) -> int:
        return -(-nbytes // HUGE_PAGE) * HUGE_PAGE if self.huge else nbytes

    def _choose_path(self, name: str, nbytes: int, hugepages: str) -> Path:
        hugetlbfs = Path("/dev/hugepages")
        enough = _free_huge_bytes() >= -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        if hugepages != "off" and hugetlbfs.is_dir() and enough and nbytes:
            self.huge = True
            folder = hugetlbfs
        elif hugepages == "require":
            raise ConfigError("hugepages=require but not enough 2 MiB huge pages are reserved")
        else:
            if hugepages == "auto":
                log_once("hugepages", "DRAM arena: no reserved 2 MiB huge pages; using 4 KiB pages")
            folder = Path("/dev/shm")
        _remove_stale_arenas(folder, f"flatcake-{name}-")
        # A per-process name: a restarted node never truncates a file that a client of the
        # previous one may still have mapped (that client would take SIGBUS, not a miss).
        return folder / f"flatcake-{name}-{os.getpid()}"

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
        # mapping until it goes; mmap.close() would raise BufferError meanwhile.
        self._map = None
        Path(self.path).unlink(missing_ok=True)

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
