"""Sealed SSD bytes made plain in the slot they were read into, before they are delivered.

A tenant's SSD pages are sealed at rest under its key (``cuda_ext/host_seal.py``, written by
``node/writer.py``); wherever they travel (an O_DIRECT read of the pool, the owner's ship
buffer over NIXL or Ray), they reach a reader's slot as they lie on the drive. Before a
filled chunk is delivered, every byte its reads brought of a checksum block the restore
wants (a block holding a wanted page: the bytes it delivers and hashes) is unsealed once,
with that block's keystream from where the byte lies in it. Rows come from the reads, not
from the chunk's checks: a page cut by a slot's end is read again whole in the next slot,
whose checks cover only the bytes not hashed before. Bytes a wrong key (or a writer other
than the node) left fail their block's check: a miss, never wrong bytes delivered.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from flatcake_ray.core.chunks import SlotRead
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.parts import LeasePart
from flatcake_ray.cuda_ext.host_seal import ctr_rows


@dataclass(frozen=True)
class SealedBlocks:
    """The wanted checksum blocks of a restore's sealed parts, as pool ranges (sorted)."""

    start: np.ndarray  # int64: pool offset of the block's first byte
    end: np.ndarray  # int64
    sums: np.ndarray  # uint64: the block's checksum, the first half of its counter block
    scopes: frozenset[int]

    @classmethod
    def of(cls, parts: Iterable[LeasePart]) -> SealedBlocks | None:
        starts, ends, sums, scopes = [], [], [], set()
        for part in parts:
            if not part.sealed or part.medium is not Medium.SSD:
                continue
            assert part.checksums is not None  # a sealed segment was written with its sums
            layout = part.layout
            block_bytes = layout.check_pages * layout.page_bytes
            blocks = np.unique(part.src_pages // layout.check_pages)
            first = blocks * block_bytes
            last = np.minimum(first + block_bytes, layout.layer_bytes)
            for layer in range(layout.layers):
                base = part.extent_offset(layer)
                starts.append(base + first)
                ends.append(base + last)
                sums.append(np.asarray(part.checksums[layer, blocks], dtype=np.uint64))
            scopes.add(part.scope_id)
        if not starts:
            return None
        start = np.concatenate(starts).astype(np.int64)
        order = np.argsort(start, kind="stable")
        end = np.concatenate(ends).astype(np.int64)[order]
        return cls(start[order], end, np.concatenate(sums)[order], frozenset(scopes))

    def unseal(self, key: bytes, reads: Sequence[SlotRead], host: np.ndarray) -> None:
        """Unseal in ``host`` (a slot) the bytes ``reads`` brought of these blocks."""
        offsets, lengths, sums, into = [], [], [], []
        for read in reads:
            lo = int(np.searchsorted(self.end, read.src, side="right"))
            hi = int(np.searchsorted(self.start, read.src + read.length, side="left"))
            if hi <= lo:
                continue
            first = np.maximum(self.start[lo:hi], read.src)
            last = np.minimum(self.end[lo:hi], read.src + read.length)
            offsets.append(read.slot_offset + first - read.src)
            lengths.append(last - first)
            sums.append(self.sums[lo:hi])
            into.append(first - self.start[lo:hi])
        if offsets:
            ctr_rows(
                key, host, np.concatenate(offsets), np.concatenate(lengths),
                np.concatenate(sums), np.concatenate(into),
            )  # fmt: skip
