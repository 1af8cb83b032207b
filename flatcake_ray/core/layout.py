"""Layer-major segment layout (FC-CIO's write-time half).

A segment is one put batch: ``pages`` pages of ``layers`` layers. All pages of layer ``l``
are one contiguous byte range, and each layer starts on a 4 KiB boundary so a layer can be
written (and read) with O_DIRECT on its own: that is what lets an engine hand over a turn
layer by layer without the store buffering the whole context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flatcake_ray.config import ALIGN
from flatcake_ray.core.extents import align_up


@dataclass(frozen=True)
class SegmentLayout:
    pages: int
    layers: int
    page_bytes: int

    @property
    def layer_bytes(self) -> int:
        return self.pages * self.page_bytes

    @property
    def layer_stride(self) -> int:
        return align_up(self.layer_bytes, ALIGN)

    @property
    def nbytes(self) -> int:
        return self.layer_stride * self.layers

    def layer_offset(self, layer: int) -> int:
        return layer * self.layer_stride

    def page_offsets(self, layer: int, pages: np.ndarray) -> np.ndarray:
        """Byte offsets (from the segment start) of ``pages`` within ``layer``."""
        return layer * self.layer_stride + np.asarray(pages, dtype=np.int64) * self.page_bytes
