"""The two real media of a node: the shared-memory DRAM arena and the O_DIRECT SSD file pool.

Both are addressed by medium-local byte offsets (the GVA's Offset field). Neither knows about
keys or scopes; the catalog decides where bytes go.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import numpy as np

from .config import ALIGN
from .errors import ConfigError

log = logging.getLogger(__name__)
HUGE_PAGE = 2 << 20
_warned: set[str] = set()


def _log_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


class AlignedBuffer:
    """Page-aligned anonymous memory (O_DIRECT needs aligned user buffers)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        self._map = mmap.mmap(-1, self.nbytes)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def close(self) -> None:
        # Views handed out may still be alive; dropping our references unmaps the memory once
        # the last view goes (mmap.close() would raise BufferError while views exist).
        self.array = np.zeros(0, dtype=np.uint8)
        self._map = None


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
                _log_once(
                    "hugepages", "DRAM arena: no reserved 2 MiB huge pages; using 4 KiB pages"
                )
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
            _log_once("cudareg", "cudaHostRegister of the DRAM arena failed: %s", result)
            return False
        return True

    def write(self, offset: int, data: np.ndarray) -> None:
        flat = data.reshape(-1).view(np.uint8)
        self.view[offset : offset + flat.size] = flat

    def close(self) -> None:
        if self.cuda_registered:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.view.ctypes.data)
        self.view = np.zeros(0, dtype=np.uint8)
        if self._map is not None:
            self._map.close()
        Path(self.path).unlink(missing_ok=True)

    @staticmethod
    def attach(path: str, nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
        """Map another process's arena read-only (the local-DRAM read path of a client)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return mapping, np.frombuffer(mapping, dtype=np.uint8)


class SsdPool:
    """Pre-allocated single-extent files, one folder per drive, opened O_DIRECT.

    File ``i`` covers pool offsets ``[i * file_bytes, (i + 1) * file_bytes)``; files are
    numbered round-robin over folders so consecutive scopes land on different drives.
    """

    def __init__(self, folders: tuple[str, ...], files_per_dir: int, file_bytes: int) -> None:
        self.file_bytes = file_bytes
        self.paths: list[str] = []
        for i in range(files_per_dir * len(folders)):
            folder = Path(folders[i % len(folders)])
            folder.mkdir(parents=True, exist_ok=True)
            self.paths.append(str(folder / f"pool-{i:04d}.fc"))
        self.direct = True
        self.fds = [self._open(path) for path in self.paths]

    def _open(self, path: str) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < self.file_bytes:
                os.posix_fallocate(fd, 0, self.file_bytes)
        finally:
            os.close(fd)
        try:
            return os.open(path, os.O_RDWR | os.O_DIRECT)
        except OSError:
            # tmpfs and some overlay filesystems refuse O_DIRECT; stay correct, say so once.
            _log_once("odirect", "SSD pool at %s: O_DIRECT refused, using buffered I/O", path)
            self.direct = False
            return os.open(path, os.O_RDWR)

    @classmethod
    def open_readonly(cls, paths: list[str] | tuple[str, ...], file_bytes: int) -> SsdPool:
        """Open another process's pool files O_DIRECT, read-only (a client's local-SSD path).

        Creates and sizes nothing: the files must exist, as the owning store made them.
        """
        pool = cls.__new__(cls)
        pool.file_bytes = file_bytes
        pool.paths = [str(p) for p in paths]
        pool.direct = True
        pool.fds = []
        try:
            for path in pool.paths:
                pool.fds.append(pool._open_readonly(path))
        except OSError:
            pool.close()
            raise
        return pool

    def _open_readonly(self, path: str) -> int:
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if not Path(path).exists():
                raise FileNotFoundError(f"SSD pool file {path} does not exist") from exc
            _log_once("odirect-ro", "SSD pool at %s: O_DIRECT refused, using buffered I/O", path)
            self.direct = False
            return os.open(path, os.O_RDONLY)

    def locate(self, offset: int) -> tuple[int, int]:
        """(file index, offset in file) of a pool offset."""
        return divmod(offset, self.file_bytes)

    def write(self, offset: int, buffer: np.ndarray) -> None:
        """Write an aligned buffer at an aligned pool offset (one command per call)."""
        file_index, file_offset = self.locate(offset)
        view = memoryview(buffer)
        while view.nbytes:
            written = os.pwrite(self.fds[file_index], view, file_offset)
            view, file_offset = view[written:], file_offset + written

    def read_into(self, file_index: int, file_offset: int, buffer: np.ndarray) -> int:
        done = 0
        while done < buffer.size:
            got = os.preadv(self.fds[file_index], [memoryview(buffer[done:])], file_offset + done)
            if got == 0:
                raise OSError(f"short read at {file_offset + done} of {self.paths[file_index]}")
            done += got
        return done

    def sync(self, offset: int) -> None:
        os.fdatasync(self.fds[self.locate(offset)[0]])

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
