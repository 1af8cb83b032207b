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
import mmap
import os
import weakref

import numpy as np

from flatcake_ray.core.runs import spans_cover

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
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_PROT_NONE = 0
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _mmap(address: int | None, nbytes: int, prot: int, flags: int, fd: int) -> int:
    got = _libc.mmap(address, nbytes, prot, flags, fd, 0)
    if got is None or got == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {nbytes} bytes failed: {os.strerror(errno)}")
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
        ``shared`` writable (the owner; a put writing in place; pre-faulted unless not
        ``populate``), or private (a reader: its writes, were it to make any, would land in
        its own copy, never the file). The caller keeps ``fd``."""
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        faulted = _MAP_POPULATE if populate else _MAP_NORESERVE
        kind = mmap.MAP_SHARED | faulted if shared else mmap.MAP_PRIVATE
        _mmap(self.base + offset, nbytes, prot, kind | _MAP_FIXED, fd)
        self.mapped[offset] = nbytes

    def unplace(self, offset: int) -> None:
        """Unmap the chunk at ``offset``: its range is reserved address space again."""
        nbytes = self.mapped.pop(offset)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
        _mmap(self.base + offset, nbytes, _PROT_NONE, flags, -1)

    def covers(self, starts: np.ndarray, lengths: np.ndarray) -> bool:
        """Whether every range ``[start, start + length)`` lies in mapped chunks."""
        return spans_cover(self.mapped.copy().items(), starts, lengths)  # place() may add
