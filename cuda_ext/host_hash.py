"""XXH3-64 of host memory on the idle cores: the block checksums of puts and restores.

The same xxh3-64 as :mod:`flatcake_ray.core.integrity` (a put's sums must equal what a reader
recomputes), computed by the system's libxxhash through ctypes, which releases the GIL for
each call, so many blocks are hashed by several threads at once (the ``xxhash`` module holds
the GIL while it hashes). Where libxxhash is not installed the callers hash with
``core.integrity`` on their own thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from flatcake_ray.cuda_ext.host_copy import SPLIT_BYTES, idle_threads, run_split


@functools.cache
def xxh3_function() -> Callable[[int, int], int] | None:
    """libxxhash's ``XXH3_64bits(address, length)``, or None where it is missing."""
    name = ctypes.util.find_library("xxhash")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).XXH3_64bits
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    function.restype = ctypes.c_uint64
    return function


def xxh3_many(pieces: Sequence[np.ndarray]) -> np.ndarray | None:
    """The XXH3-64 of each contiguous uint8 array of ``pieces`` (uint64), split over the idle
    copy threads when they add up to megabytes; None where libxxhash is missing."""
    xxh3 = xxh3_function()
    if xxh3 is None:
        return None
    found = np.empty(len(pieces), dtype=np.uint64)
    where = [(piece.ctypes.data, piece.nbytes) for piece in pieces]

    def hash_range(first: int, end: int) -> None:
        for index in range(first, end):
            found[index] = xxh3(*where[index])

    total = sum(nbytes for _, nbytes in where)
    threads = min(idle_threads() if total >= SPLIT_BYTES else 1, max(1, len(pieces)))
    bounds = np.linspace(0, len(pieces), threads + 1, dtype=np.int64).tolist()
    run_split([functools.partial(hash_range, a, b) for a, b in itertools.pairwise(bounds)])
    return found
