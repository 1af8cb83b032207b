"""FC-GVA: the 64-bit global virtual address.

``MediaType[63:60] | NodeID[59:48] | Offset[47:0]``. MediaType sits in the top bits so that
every DRAM address is numerically below ``1 << 60`` and every SSD address at or above it:
a request's slowest medium is one comparison of its largest GVA (FC-MAS relies on this).
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import numpy as np

from flatcake_ray.errors import GVAError
from flatcake_ray.gva_bits import (
    MAX_NODE_ID,
    MAX_OFFSET,
    MEDIA_SHIFT,
    NODE_SHIFT,
    SSD_FLOOR,
)


class Medium(IntEnum):
    """Media values; 2..15 are reserved for future media."""

    DRAM = 0
    SSD = 1


class DecodedGVA(NamedTuple):
    medium: Medium
    node_id: int
    offset: int


def encode(medium: Medium | int, node_id: int, offset: int) -> int:
    """Pack a GVA; raises :class:`GVAError` for any field out of range."""
    try:
        medium = Medium(int(medium))
    except ValueError as exc:
        raise GVAError(f"medium {medium!r} is not DRAM (0) or SSD (1)") from exc
    if not 0 <= int(node_id) <= MAX_NODE_ID:
        raise GVAError(f"node id {node_id} outside 0..{MAX_NODE_ID}")
    if not 0 <= int(offset) <= MAX_OFFSET:
        raise GVAError(f"offset {offset} outside 0..2**48-1")
    return (int(medium) << MEDIA_SHIFT) | (int(node_id) << NODE_SHIFT) | int(offset)


def decode(gva: int) -> DecodedGVA:
    """Unpack a GVA; raises :class:`GVAError` for a negative, oversized or reserved one."""
    if not 0 <= int(gva) < (1 << 64):
        raise GVAError(f"GVA {gva} is not a 64-bit unsigned value")
    gva = int(gva)
    raw_medium = gva >> MEDIA_SHIFT
    try:
        medium = Medium(raw_medium)
    except ValueError as exc:
        raise GVAError(f"GVA {gva:#x} has reserved medium {raw_medium}") from exc
    return DecodedGVA(medium, (gva >> NODE_SHIFT) & MAX_NODE_ID, gva & MAX_OFFSET)


def is_ssd(gva: int) -> bool:
    return int(gva) >= SSD_FLOOR


def node_of(gva: int) -> int:
    return (int(gva) >> NODE_SHIFT) & MAX_NODE_ID


def medium_of(gva: int) -> Medium:
    return decode(gva).medium


def slowest_medium(gvas: np.ndarray | list[int]) -> Medium:
    """The slowest medium a set of GVAs touches: one max and one comparison."""
    if len(gvas) == 0:
        return Medium.DRAM
    return (
        Medium.SSD if int(np.max(np.asarray(gvas, dtype=np.uint64))) >= SSD_FLOOR else Medium.DRAM
    )
