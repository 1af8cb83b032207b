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
    """The checksum of one block fed in order, possibly across several staging chunks.

    A restore makes one per block it reads (thousands), and most blocks arrive in one piece:
    the hash state is made only for a block fed in several (``feed`` of a whole block is one
    call)."""

    __slots__ = ("_hash", "expected", "scope_id")

    def __init__(self, expected: int, scope_id: int) -> None:
        self.expected = expected
        self.scope_id = scope_id
        self._hash: xxhash.xxh3_64 | None = None

    @property
    def started(self) -> bool:
        """Some of the block was fed already."""
        return self._hash is not None

    def update(self, data: np.ndarray) -> None:
        if self._hash is None:
            self._hash = xxhash.xxh3_64()
        self._hash.update(memoryview(data))

    def matches(self) -> bool:
        digest = xxhash.xxh3_64_intdigest(b"") if self._hash is None else self._hash.intdigest()
        return digest == self.expected

    def feed(self, data: np.ndarray, last: bool) -> bool:
        """Feed the next span; returns False only when ``last`` and the block's sum is wrong."""
        if last and self._hash is None:  # the whole block in one span
            return xxhash.xxh3_64_intdigest(memoryview(data)) == self.expected
        self.update(data)
        return not last or self.matches()
