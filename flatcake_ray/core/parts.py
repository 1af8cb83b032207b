"""The pages a lease wants, grouped by segment: one type for the node and for the wire.

A :class:`LeasePart` says where one segment's wanted pages sit (medium, medium-local offset,
layout, per-block checksums) and where they go in the request. The node builds them from a
catalog :class:`~flatcake_ray.core.catalog.Lease`; a storage node sends the same objects to
readers on any node (they are frozen and picklable, and carry no keys and no bytes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flatcake_ray.core.catalog import Lease
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.layout import SegmentLayout
from flatcake_ray.core.runs import run_bounds


@dataclass(frozen=True, eq=False)  # eq would compare arrays elementwise
class LeasePart:
    scope_id: int
    medium: Medium
    offset: int  # medium-local offset of the segment's layer 0, page 0
    layout: SegmentLayout
    checksums: np.ndarray | None  # uint64 [layers, blocks]; None in the replay model
    src_pages: np.ndarray  # int64, ascending: pages of the segment the lease wants
    dst_positions: np.ndarray  # int64: the request position of each of those pages
    sealed: bool = False  # SSD bytes sealed under the tenant's key: unsealed after the read

    def extent_offset(self, layer: int) -> int:
        """Medium-local offset of this segment's layer ``layer`` (its page 0)."""
        return self.offset + self.layout.layer_offset(layer)

    @property
    def first_position(self) -> int:
        return int(self.dst_positions.min())

    @property
    def pages(self) -> int:
        return len(self.src_pages)

    def at_positions(self, positions: np.ndarray) -> LeasePart:
        """The same pages, delivered to other request positions (a re-read into scratch)."""
        return dataclasses.replace(self, dst_positions=positions)

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # On the wire a run of consecutive pages (a whole prefix in one segment, the common
        # lease) is its first page and length, not 8 bytes a page each way.
        fields = (self.scope_id, self.medium, self.offset, self.layout, self.checksums)
        runs = (_as_run(self.src_pages), _as_run(self.dst_positions))
        return _unpacked_part, (fields, *runs, self.sealed)


def _as_run(values: np.ndarray) -> tuple[int, int] | np.ndarray:
    """``(first, count)`` when ``values`` are consecutive ascending ints, else ``values``."""
    count = len(values)
    if count and int(values[-1]) - int(values[0]) == count - 1 and np.all(np.diff(values) == 1):
        return int(values[0]), count
    return values


def _from_run(packed: tuple[int, int] | np.ndarray) -> np.ndarray:
    if isinstance(packed, tuple):
        first, count = packed
        return np.arange(first, first + count, dtype=np.int64)
    return packed


def _unpacked_part(
    fields: tuple[int, Medium, int, SegmentLayout, np.ndarray | None],
    src: tuple[int, int] | np.ndarray,
    dst: tuple[int, int] | np.ndarray,
    sealed: bool,
) -> LeasePart:
    return LeasePart(*fields, _from_run(src), _from_run(dst), sealed)


def lease_parts(lease: Lease) -> tuple[LeasePart, ...]:
    """A lease's pages grouped by segment (no I/O), each part's pages ascending."""
    order = np.lexsort((lease.pages, lease.segment_ids))
    ids = lease.segment_ids[order]
    cuts = np.flatnonzero(np.diff(ids)) + 1
    parts = []
    for group in np.split(order, cuts):
        if not group.size:
            continue
        segment = lease.segments[int(lease.segment_ids[group[0]])]
        parts.append(
            LeasePart(
                segment.scope_id,
                segment.medium,
                segment.offset,
                segment.layout,
                segment.checksums,
                np.asarray(lease.pages[group], dtype=np.int64),
                np.asarray(group, dtype=np.int64),
                segment.sealed,
            )
        )
    return tuple(parts)


def first_positions(parts: Sequence[LeasePart]) -> dict[int, int]:
    """Each scope's first request position: where the verified prefix ends if it fails."""
    first: dict[int, int] = {}
    for part in parts:
        known = first.get(part.scope_id, part.first_position)
        first[part.scope_id] = min(part.first_position, known)
    return first


def wanted_bytes(parts: Sequence[LeasePart], medium: Medium) -> int:
    """Bytes of every layer of the wanted pages on ``medium`` (FC-MAS's ``kv_bytes``)."""
    return sum(p.pages * p.layout.layers * p.layout.page_bytes for p in parts if p.medium is medium)


def filled_bytes(part: LeasePart, verify: bool) -> int:
    """Bytes of one layer of ``part`` a filled medium reads (whole blocks when verifying)."""
    layout = part.layout
    if not verify:
        return part.pages * layout.page_bytes
    blocks = np.unique(part.src_pages // layout.check_pages)
    return min(layout.layer_bytes, len(blocks) * layout.check_pages * layout.page_bytes)


def block_ranges(part: LeasePart) -> list[tuple[int, int]]:
    """[first, end) pages of the runs of whole checksum blocks holding the wanted pages."""
    layout = part.layout
    blocks = np.unique(part.src_pages // layout.check_pages)
    return [
        (
            int(blocks[a]) * layout.check_pages,
            min(layout.pages, (int(blocks[b - 1]) + 1) * layout.check_pages),
        )
        for a, b in run_bounds(blocks)
    ]


def page_ranges(part: LeasePart) -> list[tuple[int, int]]:
    src = part.src_pages
    return [(int(src[a]), int(src[b - 1]) + 1) for a, b in run_bounds(src)]
