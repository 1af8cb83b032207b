"""The memfds behind a node's chunks, and how one is retired when its chunk changes hands.

A chunk that goes to another tenant gets a fresh memfd (``DramArena.renew_chunk``), so a
process that mapped the old one (the former tenant's client) reaches nothing the next
tenant writes. The old file is then *retired*: its pages are punched out (the memory goes
back to the machine at once, whoever still maps it) and it is sealed against growing and
shrinking, which is the mark a client that kept its descriptor checks before it trusts a
mapping of it (:func:`is_retired`). Punched, not truncated: a mapping past a file's end
raises SIGBUS on touch, which would kill a client that touched a stale mapping (one whose
put outlived its TTL, say); a punched page reads as zeros (its checksums fail: a miss) and
a write there lands in memory no one else sees. A page a stale mapping touches again is
charged to that process, as any memory it allocates.
"""

from __future__ import annotations

import ctypes
import fcntl
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_RETIRED = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK


def new_chunk_file(name: str, nbytes: int, *, huge: bool) -> int:
    """A memfd of ``nbytes``, sealable (so it can be retired), nothing allocated yet."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if huge else 0)
    fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def retire(fd: int) -> None:
    """Free every page of the chunk file ``fd`` and mark it retired (its size stays)."""
    size = os.fstat(fd).st_size
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"punching a retired chunk failed: {os.strerror(errno)}")
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _RETIRED)


def is_retired(fd: int) -> bool:
    """Whether the chunk file ``fd`` was retired (its chunk has a fresh file now)."""
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _RETIRED == _RETIRED
