"""A finished layer's block checksums, on the cores that are idle (``cuda_ext/host_hash.py``:
libxxhash through ctypes, the GIL released); ``core.integrity.layer_checksums`` on the
caller's thread where libxxhash is missing or no core is idle.
"""

from __future__ import annotations

import numpy as np

from flatcake_ray.core.integrity import layer_checksums
from flatcake_ray.core.layout import SegmentLayout
from flatcake_ray.cuda_ext.host_copy import SPLIT_BYTES, idle_threads
from flatcake_ray.cuda_ext.host_hash import xxh3_many


def parallel_layer_checksums(extent: np.ndarray, layout: SegmentLayout) -> np.ndarray:
    """``layer_checksums(extent, layout)``, the blocks split over the idle copy threads."""
    threads = idle_threads() if layout.layer_bytes >= SPLIT_BYTES else 1
    if threads == 1 or layout.blocks < 2:
        return layer_checksums(extent, layout)
    block_bytes = layout.check_pages * layout.page_bytes
    end = layout.layer_bytes
    blocks = [extent[start : min(start + block_bytes, end)] for start in range(0, end, block_bytes)]
    sums = xxh3_many(blocks)
    return layer_checksums(extent, layout) if sums is None else sums
