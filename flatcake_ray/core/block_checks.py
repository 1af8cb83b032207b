"""Which bytes of a chunk feed which checksum block, in the two shapes a restore uses.

- :class:`BlockRows`: whole blocks of one layer, a row each in arrays: those of a mapped
  medium (the local DRAM arena), and those a filled chunk's slot (SSD, remote DRAM) holds
  whole. A checked restore of 3,421 pages x 4 layers holds thousands of blocks, and making
  an object per block cost more than copying its bytes (planning a filled restore took 4 ms
  that way); the reader hashes the rows in one native batch (``restore/copy_check.py``) and
  makes spans only of the few it must feed piece by piece (:meth:`BlockRows.spans`).
- :class:`HashSpan`: one span of one block with its streaming check, an object each: a block
  a filled chunk's slot cuts (it arrives in pieces over several slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from flatcake_ray.core.integrity import StreamingCheck
from flatcake_ray.core.parts import LeasePart


class HashSpan(NamedTuple):  # a tuple: a restore makes one per checksum block
    layer: int
    check: StreamingCheck
    offset: int  # bytes into the chunk's source (its slot, or the mapped medium)
    length: int
    last: bool  # the block's final bytes: decide the check after feeding these


@dataclass(frozen=True)
class BlockRows:
    """Whole checksum blocks of ``layer`` in a chunk's source (the mapped medium, or a slot),
    sorted by offset."""

    layer: int
    offset: np.ndarray  # int64: bytes into the chunk's source
    length: np.ndarray  # int64
    expected: np.ndarray  # uint64: the sum the writer recorded
    scope: np.ndarray  # int64: whose block

    @classmethod
    def of_part(cls, part: LeasePart, layer: int, base: int) -> BlockRows:
        """The blocks of ``part``'s ``layer`` that hold a wanted page; ``base``: the medium
        offset of the layer's extent."""
        layout = part.layout
        assert part.checksums is not None  # a live segment: written with its sums
        blocks = np.unique(part.src_pages // layout.check_pages)
        first = blocks * layout.check_pages
        end = np.minimum(first + layout.check_pages, layout.pages)
        return cls(
            layer,
            base + first * layout.page_bytes,
            (end - first) * layout.page_bytes,
            np.asarray(part.checksums[layer, blocks], dtype=np.uint64),
            np.full(len(blocks), part.scope_id, dtype=np.int64),
        )

    @classmethod
    def joined(cls, layer: int, rows: list[BlockRows]) -> BlockRows:
        """``rows`` (of ``layer``) as one, sorted by offset."""
        if len(rows) == 1:
            return rows[0]
        offset = np.concatenate([r.offset for r in rows]) if rows else np.zeros(0, np.int64)
        order = np.argsort(offset, kind="stable")

        def column(name: str, dtype: type) -> np.ndarray:
            if not rows:
                return np.zeros(0, dtype)
            return np.concatenate([getattr(r, name) for r in rows])[order]

        return cls(
            layer, offset[order], column("length", np.int64),
            column("expected", np.uint64), column("scope", np.int64),
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.offset)

    def at(self, index: np.ndarray | slice) -> BlockRows:
        return BlockRows(
            self.layer, self.offset[index], self.length[index],
            self.expected[index], self.scope[index],
        )  # fmt: skip

    def spans(self) -> list[HashSpan]:
        """One whole-block span each, for the reader that feeds blocks piece by piece."""
        return [
            HashSpan(self.layer, StreamingCheck(expected, scope), offset, length, True)
            for offset, length, expected, scope in zip(
                self.offset.tolist(), self.length.tolist(),
                self.expected.tolist(), self.scope.tolist(), strict=True,
            )
        ]  # fmt: skip


class RowsByOffset:
    """Blocks at ``offset`` of ``length`` bytes (sorted), each taken once, by the first byte
    range that overlaps it (ranges asked in ascending order: a block is checked with the
    chunk copying its first pages)."""

    def __init__(self, offset: np.ndarray, length: np.ndarray) -> None:
        self._offset = offset
        self._ends = offset + length
        self._next = 0  # blocks before this one are taken

    def take(self, lo: int, hi: int) -> tuple[int, int]:
        """``[start, stop)``: the blocks not taken yet that overlap bytes ``[lo, hi)``."""
        start = self._next + int(np.searchsorted(self._ends[self._next :], lo, side="right"))
        stop = max(start, int(np.searchsorted(self._offset, hi, side="left")))
        self._next = max(self._next, stop)
        return start, stop
