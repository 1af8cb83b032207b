"""Files mapped side by side into one reserved range of address space, by ``MAP_FIXED``.

The arena of a node is several memfds (its chunks, ``media/arena.py``), but everything that
reads or writes it (the writer, the readers, the NIXL and RDMA exports) wants one contiguous
view addressed by arena offset. So the range is reserved (``PROT_NONE``, no memory behind
it) and each chunk's file is mapped over its own part of it. A client maps only the chunks
it was handed: the rest of its range stays ``PROT_NONE``, and :meth:`ChunkMap.covers` says
whether a range lies in mapped chunks before anything touches it.

The range is unmapped when the last numpy view of it goes (the views keep their base, a
ctypes array, alive; a finalizer on that array unmaps).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import weakref

import numpy as np

from flatcake_ray.core.runs import spans_cover
from flatcake_ray.media.log import log_once

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_PROT_NONE = 0
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels answer EINVAL


def _mmap(address: int | None, nbytes: int, prot: int, flags: int, fd: int) -> int:
    got = _libc.mmap(address, nbytes, prot, flags, fd, 0)
    if got is None or got == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, f"mmap of {nbytes} bytes failed: {os.strerror(code)}")
    return int(got)


# A hugetlb file maps only at an address that is a whole number of its pages, and its length
# is rounded up to them: every range is reserved so (address space only, no memory), since a
# process mapping a node's chunks does not know which kind they are.
HUGE_PAGE = 2 << 20


class ChunkMap:
    """``nbytes`` of reserved address space (on a huge page's boundary) that files are mapped
    into."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        raw = _mmap(None, span, _PROT_NONE, flags, -1)
        self.base = -(-raw // HUGE_PAGE) * HUGE_PAGE
        self._array = (ctypes.c_uint8 * max(nbytes, 1)).from_address(self.base)
        weakref.finalize(self._array, _libc.munmap, raw, span)
        self.view = np.frombuffer(self._array, dtype=np.uint8)[:nbytes]
        self.mapped: dict[int, int] = {}  # offset -> bytes of every chunk mapped

    def place(
        self, offset: int, fd: int, nbytes: int, *, shared: bool, populate: bool = True
    ) -> None:
        """Map ``nbytes`` of the file open as ``fd`` at ``offset``, over whatever was there:
        ``shared`` writable (the owner; a put writing in place; every page allocated and
        faulted in for writing unless not ``populate``), or private (a reader: its writes,
        were it to make any, would land in its own copy, never the file). The caller keeps
        ``fd``.

        Every mapping asks for transparent huge pages before a page is faulted in: where
        the administrator set ``shmem_enabled = advise`` a chunk's pages are then 2 MiB, and
        a peer's cross-memory READ of them (UCX on one machine) pins a page per 2 MiB
        instead of per 4 KiB (``benchmarks/nixl_owner_memory.py``). Where it is ``never``
        the advice changes nothing."""
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        address = self.base + offset
        kind = mmap.MAP_SHARED | _MAP_NORESERVE if shared else mmap.MAP_PRIVATE
        _mmap(address, nbytes, prot, kind | _MAP_FIXED, fd)
        self.mapped[offset] = nbytes
        _advise_huge(address, nbytes)
        if shared and populate and not _populate_for_writing(address, nbytes):
            # A kernel without MADV_POPULATE_WRITE: the file's pages allocated, then mapped
            # populated (which faults a shared mapping in for reading only).
            os.posix_fallocate(fd, 0, nbytes)
            _mmap(address, nbytes, prot, mmap.MAP_SHARED | _MAP_POPULATE | _MAP_FIXED, fd)

    def unplace(self, offset: int) -> None:
        """Unmap the chunk at ``offset``: its range is reserved address space again."""
        nbytes = self.mapped.pop(offset)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
        _mmap(self.base + offset, nbytes, _PROT_NONE, flags, -1)

    def covers(self, starts: np.ndarray, lengths: np.ndarray) -> bool:
        """Whether every range ``[start, start + length)`` lies in mapped chunks."""
        return spans_cover(self.mapped.copy().items(), starts, lengths)  # place() may add


def _advise_huge(address: int, nbytes: int) -> None:
    if _libc.madvise(address, nbytes, mmap.MADV_HUGEPAGE) != 0:  # a kernel without THP
        code = ctypes.get_errno()
        log_once("chunk-thp", "no transparent huge pages for DRAM chunks: %s", os.strerror(code))


def _populate_for_writing(address: int, nbytes: int) -> bool:
    """Fault every page of a shared mapping in for writing (allocating what the file lacks,
    huge where the mapping's advice allows); False where the kernel cannot."""
    if _libc.madvise(address, nbytes, _MADV_POPULATE_WRITE) == 0:
        return True
    code = ctypes.get_errno()
    if code == errno.EINVAL:  # the advice is unknown to this kernel
        return False
    raise OSError(code, f"faulting in {nbytes} bytes of a chunk failed: {os.strerror(code)}")
