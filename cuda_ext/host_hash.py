"""XXH3-64 of host memory on the idle cores: the block checksums of puts and restores, and
copies fused with them.

The same xxh3-64 as :mod:`flatcake_ray.core.integrity` (a put's sums must equal what a reader
recomputes), computed by the system's libxxhash. With ``cuda_ext/_copyhash.c`` built (pip
install does), a batch of copies and hashes runs on the copy threads with the GIL released
(``host_copy.run_ops``), and a piece that is copied is hashed inside its copy loop (AVX2), or
right after its copy while it is in cache (:func:`copy_and_hash`). Without it, ``xxh3_many``
calls libxxhash through ctypes per piece (ctypes releases the GIL too) and
:func:`copy_and_hash` answers None: the callers copy, then hash. Where libxxhash is not
installed either, the callers hash with ``core.integrity`` on their own thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from flatcake_ray.cuda_ext.host_copy import (
    HASH_AT,
    LENGTH,
    SPLIT_BYTES,
    batch_threads,
    claim_step,
    idle_threads,
    native_module,
    op_rows,
    run_ops,
    run_split,
)


@functools.cache
def xxh3_function() -> Callable[[int, int], int] | None:
    """libxxhash's XXH3-64 of ``(address, length)``, or None where it is missing: its
    ``XXH3_64bits_dispatch`` where the library has it (the same hash, with the widest vector
    unit the CPU has: 1.8x ``XXH3_64bits``' SSE2 here on 64 KiB blocks), else ``XXH3_64bits``."""
    name = ctypes.util.find_library("xxhash")
    if name is None:
        return None
    try:
        library = ctypes.CDLL(name)
    except OSError:
        return None
    for symbol in ("XXH3_64bits_dispatch", "XXH3_64bits"):
        try:
            function = library[symbol]
        except AttributeError:  # a library built without the dispatcher
            continue
        function.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        function.restype = ctypes.c_uint64
        return function
    return None


@functools.cache
def _native() -> tuple[Any, int] | None:
    """(the ``_copyhash`` module, libxxhash's XXH3 address), or None where either is missing."""
    xxh3 = xxh3_function()
    module = native_module()
    if module is None or xxh3 is None:
        return None
    address = ctypes.cast(cast(Any, xxh3), ctypes.c_void_p).value  # a ctypes function
    return None if address is None else (module, address)


def fused() -> bool:
    """Copies and hashes run as one native pass (:func:`copy_and_hash` answers)."""
    return _native() is not None


def copy_and_hash(ops: np.ndarray) -> np.ndarray | None:
    """Run a batch of ``ops`` (int64 rows of ``DST, SRC, LENGTH, HASH_AT``; every address a
    valid range of the caller's live arrays) on the idle copy threads, and return each op's
    hash (uint64; 0 where ``HASH_AT`` is 0); None, with nothing done, where the native module
    or libxxhash is missing."""
    native = _native()
    if native is None:
        return None
    module, address = native
    return run_ops(module, ops, address)


def pieces_pass() -> bool:
    """:func:`copy_and_hash_pieces` runs here (the native module, built, on a CPU with AVX2)."""
    module = native_module()
    return module is not None and bool(module.pieces_pass())


def copy_and_hash_pieces(rows: np.ndarray, pieces: np.ndarray) -> np.ndarray:
    """Copy each row's bytes into its pieces and return their XXH3-64s (uint64), hashed in
    the copy's own pass, on the idle copy threads. ``rows``: int64 ``(src, length,
    first_piece, piece_bytes)``, a row's ``length`` over 240 and whole pieces of a multiple
    of 64 bytes; ``pieces``: int64 destination addresses. Every address a valid range of the
    caller's live memory; only where :func:`pieces_pass` (ValueError otherwise)."""
    module = native_module()
    if module is None:
        raise ValueError("the native copy module is not built")
    rows = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1, 4)
    pieces = np.ascontiguousarray(pieces, dtype=np.int64)
    threads = batch_threads(rows[:, 1])
    sums = np.zeros(len(rows), dtype=np.uint64)
    claimed = np.zeros(1, dtype=np.int64)
    step = claim_step(rows[:, 1], threads)
    call = functools.partial(module.copy_hash_pieces, rows, pieces, sums, claimed, step)
    run_split([call] * threads)
    return sums


def copy_hashing_source(dst: np.ndarray, src: np.ndarray, block_bytes: int) -> np.ndarray | None:
    """Copy ``src`` into ``dst`` (C-contiguous, as many bytes) and return the XXH3-64 of each
    ``block_bytes`` of ``src`` (the last block may be shorter), each block hashed right after
    its copy; None, with nothing copied, where the fused native pass is missing."""
    if not fused():
        return None
    if not (dst.flags.c_contiguous and src.flags.c_contiguous) or dst.nbytes != src.nbytes:
        raise ValueError("a fused copy needs two C-contiguous arrays of as many bytes")
    starts = np.arange(0, src.nbytes, block_bytes, dtype=np.int64)
    sources = src.ctypes.data + starts
    lengths = np.minimum(block_bytes, src.nbytes - starts)
    return copy_and_hash(op_rows(dst.ctypes.data + starts, sources, lengths, sources))


def xxh3_many(pieces: Sequence[np.ndarray]) -> np.ndarray | None:
    """The XXH3-64 of each contiguous uint8 array of ``pieces`` (uint64), split over the idle
    copy threads when they add up to megabytes; None where libxxhash is missing."""
    xxh3 = xxh3_function()
    if xxh3 is None:
        return None
    where = [(piece.ctypes.data, piece.nbytes) for piece in pieces]
    if fused():
        ops = np.zeros((len(where), 4), dtype=np.int64)
        if where:
            ops[:, HASH_AT], ops[:, LENGTH] = np.array(where, dtype=np.int64).T
        return copy_and_hash(ops)
    found = np.empty(len(pieces), dtype=np.uint64)

    def hash_range(first: int, end: int) -> None:
        for index in range(first, end):
            found[index] = xxh3(*where[index])

    total = sum(nbytes for _, nbytes in where)
    threads = min(idle_threads() if total >= SPLIT_BYTES else 1, max(1, len(pieces)))
    bounds = np.linspace(0, len(pieces), threads + 1, dtype=np.int64).tolist()
    run_split([functools.partial(hash_range, a, b) for a, b in itertools.pairwise(bounds)])
    return found
