"""Layer-major segment layout (FC-CIO's write-time half).

A segment is one put batch: ``pages`` pages of ``layers`` layers. All pages of layer ``l``
are one contiguous byte range, and each layer starts on a 4 KiB boundary so a layer can be
written (and read) with O_DIRECT on its own: that is what lets an engine hand over a turn
layer by layer without the store buffering the whole context.

Integrity is checked per *block*: ``check_pages`` consecutive pages of one layer (the last
block of a layer may be shorter). A read covers whole blocks, so a restore that wants part of
a segment reads only the blocks holding its pages (read amplification at most one block per
layer at each end of a wanted run), and every byte delivered was verified.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flatcake_ray.config import ALIGN
from flatcake_ray.core.runs import align_up


@dataclass(frozen=True)
class SegmentLayout:
    pages: int
    layers: int
    page_bytes: int
    check_pages: int = 1  # pages per checksum block

    @property
    def layer_bytes(self) -> int:
        return self.pages * self.page_bytes

    @property
    def layer_stride(self) -> int:
        return align_up(self.layer_bytes, ALIGN)

    @property
    def nbytes(self) -> int:
        return self.layer_stride * self.layers

    @property
    def blocks(self) -> int:
        """Checksum blocks per layer."""
        return -(-self.pages // self.check_pages)

    def layer_offset(self, layer: int) -> int:
        return layer * self.layer_stride

    def page_offsets(self, layer: int, pages: np.ndarray) -> np.ndarray:
        """Byte offsets (from the segment start) of ``pages`` within ``layer``."""
        return layer * self.layer_stride + np.asarray(pages, dtype=np.int64) * self.page_bytes

    def block_pages(self, block: int) -> tuple[int, int]:
        """[first, end) pages of checksum block ``block``."""
        first = block * self.check_pages
        return first, min(self.pages, first + self.check_pages)


def check_pages_for(check_bytes: int, page_bytes: int) -> int:
    """Pages per checksum block: as many whole pages as fit ``check_bytes`` (at least one)."""
    return max(1, check_bytes // page_bytes)
