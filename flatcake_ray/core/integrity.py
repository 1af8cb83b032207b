"""Checksums of stored bytes: xxh3-64 per checksum block (see ``core/layout.py``).

Written when a layer of a segment is complete, verified on every SSD read (and on DRAM reads
with ``verify_dram``). A mismatch means the medium or a reuse of the space changed the
bytes: the reader treats the pages as a miss, never as data.
"""

from __future__ import annotations

import numpy as np
import xxhash

from flatcake_ray.core.layout import SegmentLayout


def checksum(data: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(data))


def layer_checksums(extent: np.ndarray, layout: SegmentLayout) -> np.ndarray:
    """One checksum per block of a layer extent (``layer_bytes`` bytes, pages back to back)."""
    return block_checksums(extent[: layout.layer_bytes], layout.check_pages * layout.page_bytes)


def block_checksums(data: np.ndarray, block_bytes: int) -> np.ndarray:
    """One checksum per ``block_bytes`` of ``data`` (1-D bytes; the last block may be shorter):
    what a writer sends with the layer it wrote into an owner's memory."""
    blocks = -(-data.nbytes // block_bytes)
    sums = np.empty(blocks, dtype=np.uint64)
    for block in range(blocks):
        sums[block] = checksum(data[block * block_bytes : (block + 1) * block_bytes])
    return sums


class StreamingCheck:
    """The checksum of one block fed in order, possibly across several staging chunks."""

    def __init__(self, expected: int, scope_id: int) -> None:
        self.expected = expected
        self.scope_id = scope_id
        self._hash = xxhash.xxh3_64()

    def update(self, data: np.ndarray) -> None:
        self._hash.update(memoryview(data))

    def matches(self) -> bool:
        return self._hash.intdigest() == self.expected
