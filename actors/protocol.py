"""What crosses the wire between clients, storage nodes and the coordinator.

Everything here is a frozen, picklable value: the service configuration, a storage node's
self-description (how to reach its media), a lease reply (where a request's pages sit) and a
staged put (where the bytes of a put wait). No bytes of a page ride in any of them, except
in :class:`StagedPages` of kind ``inline`` (the object-store fallback, labelled as such).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flatcake_ray.core.gva import Medium

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
class SegmentPart:
    """The pages a lease wants from one segment: where they sit and where they go."""

    scope_id: int
    medium: Medium
    offset: int  # medium-local offset of the segment's layer 0, page 0
    pages: int  # pages in the segment
    page_bytes: int
    layer_stride: int
    checksums: np.ndarray  # per layer, of the layer's pages (layer_stride padding excluded)
    src_pages: np.ndarray  # int64, index inside the segment
    dst_positions: np.ndarray  # int64, index in the request

    @property
    def layer_bytes(self) -> int:
        return self.pages * self.page_bytes

    def layer_offset(self, layer: int) -> int:
        return self.offset + layer * self.layer_stride


@dataclass(frozen=True)
class LeaseReply:
    """One node's answer to a lookup: its consecutive hits, pinned until released."""

    node_id: int
    lease_id: int
    hits: int
    parts: tuple[SegmentPart, ...] = ()

    @property
    def media(self) -> set[str]:
        return {part.medium.name for part in self.parts}


@dataclass(frozen=True)
class StagedPages:
    """Where the bytes of a put wait for the owner: a client's shared-memory staging buffer
    (same node), the same buffer exported over NIXL (other node), or, as the labelled last
    resort, inline in the call (through the Ray object store)."""

    kind: str  # "shm" | "nixl" | "inline"
    layers: int
    pages: int
    page_bytes: int
    offset: int = 0  # byte offset of the pages in the staging buffer
    path: str = ""  # kind "shm": where the owner maps the staging memory (/proc/<pid>/fd/<fd>)
    token: str = ""  # names that staging buffer (fd numbers are reused): the mapping's key
    buffer_bytes: int = 0  # size of the whole staging buffer
    peer: Any = None  # kind "nixl": NixlPeerInfo of the staging buffer
    inline: np.ndarray | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.layers * self.pages * self.page_bytes
