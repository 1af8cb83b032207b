"""A finished layer's block checksums, on the cores that are idle.

The same xxh3-64 as :mod:`flatcake_ray.core.integrity` (a put's sums must equal what a reader
recomputes), computed by the system's libxxhash through ctypes, which releases the GIL for
each call, so the blocks of a layer are hashed by several threads at once (the ``xxhash``
module holds the GIL while it hashes). Where libxxhash is not installed, or no core is idle,
``core.integrity.layer_checksums`` computes them on the caller's thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
from collections.abc import Callable

import numpy as np

from flatcake_ray.core.integrity import layer_checksums
from flatcake_ray.core.layout import SegmentLayout
from flatcake_ray.cuda_ext.host_copy import SPLIT_BYTES, idle_threads, run_split


@functools.cache
def _xxh3() -> Callable[[int, int], int] | None:
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


def parallel_layer_checksums(extent: np.ndarray, layout: SegmentLayout) -> np.ndarray:
    """``layer_checksums(extent, layout)``, the blocks split over the idle copy threads."""
    xxh3 = _xxh3()
    threads = idle_threads() if layout.layer_bytes >= SPLIT_BYTES else 1
    if xxh3 is None or threads == 1 or layout.blocks < 2:
        return layer_checksums(extent, layout)
    block_bytes = layout.check_pages * layout.page_bytes
    sums = np.empty(layout.blocks, dtype=np.uint64)
    base = extent.ctypes.data

    def hash_blocks(first: int, end: int) -> None:
        for block in range(first, end):
            start = block * block_bytes
            sums[block] = xxh3(base + start, min(block_bytes, layout.layer_bytes - start))

    bounds = np.linspace(0, layout.blocks, threads + 1, dtype=np.int64).tolist()
    run_split([functools.partial(hash_blocks, a, b) for a, b in itertools.pairwise(bounds)])
    return sums
