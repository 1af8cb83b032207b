"""What crosses the wire between clients, storage nodes and the coordinator.

Everything here is a frozen, picklable value: the service configuration, a storage node's
self-description (how to reach its media), a lease reply (where a request's pages sit) and a
staged put (where the bytes of a put wait). No bytes of a page ride in any of them, except
in :class:`StagedPages` of kind ``inline`` (the object-store fallback, labelled as such).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from flatcake_ray.core.parts import LeasePart

COORDINATOR_NAME = "flatcake-coordinator"
NODE_NAME_PREFIX = "flatcake-node-"
NO_LOCAL_NODE = 0  # NodeIDs start at 1, so 0 means "this process has no storage node"


def node_actor_name(ray_node_id: str) -> str:
    return NODE_NAME_PREFIX + ray_node_id


@dataclass(frozen=True)
class NodeDescription:
    """How a reader anywhere reaches one storage node's media (one call, then cached)."""

    ray_node_id: str
    node_id: int
    actor_name: str
    layers: int
    page_bytes: int
    arena_path: str
    arena_bytes: int
    pool_paths: tuple[str, ...]
    pool_file_bytes: int
    pool_direct: bool
    started_at: float  # wall clock; a changed value means the node restarted
    arena_nixl: Any = None  # NixlPeerInfo of the arena, None when NIXL is unusable there
    ship_nixl: Any = None  # NixlPeerInfo of the ship (bounce) buffer
    nixl_reason: str | None = None  # why NIXL is unusable on that node
    rdma: bool = False  # the arena is exported for one-sided RDMA READs (accept_rdma)
    verify_dram: bool = False  # readers check DRAM blocks too (SSD blocks always)
    gap_bytes: int = 64 << 10  # coalescing: holes smaller than this are read and dropped
    tenant: str = "default"  # whose geometry ``layers`` and ``page_bytes`` are


@dataclass(frozen=True)
class NodeUsage:
    """A storage node's capacity and use per medium, as reported to the coordinator."""

    node_id: int
    dram_capacity: int
    dram_used: int
    ssd_capacity: int
    ssd_used: int
    scopes: int
    pages: int

    @property
    def free_bytes(self) -> int:
        return max(0, self.dram_capacity - self.dram_used) + max(
            0, self.ssd_capacity - self.ssd_used
        )

    @classmethod
    def from_stats(cls, node_id: int, stats: Mapping[str, Any]) -> NodeUsage:
        return cls(
            node_id,
            int(stats["dram_capacity"]),
            int(stats["dram_used"]),
            int(stats["ssd_capacity"]),
            int(stats["ssd_reserved"]),
            int(stats["scopes"]),
            int(stats["pages_indexed"]),
        )


@dataclass(frozen=True)
class LeaseReply:
    """One node's answer to a lookup: its consecutive hits, pinned until released."""

    node_id: int
    lease_id: int
    hits: int
    parts: tuple[LeasePart, ...] = ()

    @property
    def media(self) -> set[str]:
        return {part.medium.name for part in self.parts}


class StagingKind(Enum):
    """Where the bytes of a staged put wait for the owner."""

    SHM = "shm"  # a client's shared-memory staging buffer, mapped by the owner (same node)
    NIXL = "nixl"  # the same buffer exported over NIXL, pulled by the owner (other node)
    INLINE = "inline"  # LAST RESORT: in the call itself, through the Ray object store


@dataclass(frozen=True)
class StagedPiece:
    """Pages of keys ``[first, first + count)`` of one layer, at ``offset`` of the staging."""

    layer: int
    first: int
    count: int
    offset: int


@dataclass(frozen=True)
class StagedPages:
    """Where the bytes of (part of) a put wait for the owner, and which pages they are."""

    kind: StagingKind
    page_bytes: int
    pieces: tuple[StagedPiece, ...]
    offset: int = 0  # byte offset of the staged bytes in the staging buffer
    nbytes: int = 0  # staged bytes from ``offset``
    path: str = ""  # SHM: where the owner maps the staging memory (/proc/<pid>/fd/<fd>)
    token: str = ""  # names that staging buffer (fd numbers are reused): the mapping's key
    buffer_bytes: int = 0  # size of the whole staging buffer
    peer: Any = None  # NIXL: NixlPeerInfo of the staging buffer
    inline: np.ndarray | None = field(default=None, repr=False)


@dataclass(frozen=True)
class PutTicket:
    """A layer-wise put the owner planned and holds open (see ``StorageNode.begin_put``)."""

    put_id: int
    pages_new: int
