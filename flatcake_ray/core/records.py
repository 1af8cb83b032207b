"""The catalog's records: sessions, scopes, segments, put plans, leases and ids (no rules).

They sit below every part of the catalog (:mod:`~flatcake_ray.core.catalog` and the parts it
holds: allocation, reclamation, replicas), which all read and change them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from flatcake_ray.core.extents import ScopeRuns
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.layout import SegmentLayout
from flatcake_ray.core.tenants import DEFAULT_TENANT

SessionId = str | int | bytes


@dataclass(frozen=True)
class PutHints:
    """Placement signals an engine may know better than the store can infer."""

    prefix_refcount: int | None = None
    turn: int | None = None
    prior_reply_tokens: int | None = None
    context_tokens: int | None = None


@dataclass
class Segment:
    segment_id: int
    scope_id: int
    medium: Medium
    offset: int  # medium-local byte offset of layer 0, page 0
    layout: SegmentLayout
    digests: np.ndarray  # one per page, in page order
    checksums: np.ndarray | None = None  # uint64 [layers, blocks], set as layers are written
    continuations: int = 0  # later puts that continued from this segment's last page
    # A DRAM read replica of this (SSD) segment: same id, layout, digests and checksums,
    # its own scope and offset. Readers are handed it instead of the segment while it lives.
    replica: Segment | None = None
    # Written sealed under its tenant's key (``cuda_ext/host_seal.py``): readers unseal it.
    sealed: bool = False


@dataclass
class Scope:
    scope_id: int
    session_id: SessionId
    medium: Medium
    runs: ScopeRuns = field(default_factory=ScopeRuns)
    segments: list[int] = field(default_factory=list)
    refs: int = 0  # leases plus in-flight puts
    pages: int = 0
    # A replica scope holds one DRAM read replica (of one SSD segment of scope replica_of):
    # replicas are dropped one segment at a time, least recently read first.
    replica_of: int | None = None

    @property
    def is_replica(self) -> bool:
        return self.replica_of is not None


@dataclass
class Session:
    session_id: SessionId
    turns: int = 0
    context_pages: int = 0
    scopes: dict[Medium, int] = field(default_factory=dict)  # home scopes, one per medium


@dataclass
class PutPlan:
    segment: Segment
    new_positions: np.ndarray  # positions in the caller's key list of the pages written
    session_id: SessionId
    rule: str
    turn: int
    parent_segment: int | None
    # Where the same bytes also go in DRAM (a droppable read replica), or None. The writer
    # writes both; publish makes the replica readable together with the segment.
    replica: Segment | None = None


@dataclass
class Lease:
    """The located prefix of a request; its scopes cannot be reclaimed until release."""

    lease_id: int
    segment_ids: np.ndarray  # per page
    pages: np.ndarray  # per page: index inside its segment
    scope_ids: tuple[int, ...]
    # Held here so a quarantine mid-read cannot pull them away. A segment with a live
    # replica appears as its replica (medium DRAM): that is the copy the reader reads.
    segments: dict[int, Segment]
    tenant: str = DEFAULT_TENANT  # whose catalog holds it

    @property
    def hits(self) -> int:
        return len(self.pages)


class Ids:
    """Ids of scopes, segments, leases and automatic sessions: unique across every catalog of
    a store (the tenants' catalogs share one), never reused, and kept above the ids a
    restarted store recovers."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def __next__(self) -> int:
        return next(self._next)

    def skip_below(self, floor: int) -> None:
        self._next = itertools.count(max(floor, next(self._next)))
