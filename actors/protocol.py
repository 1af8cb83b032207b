"""What crosses the wire between clients, storage nodes and the coordinator.

Everything here is a frozen, picklable value: the service configuration, a storage node's
self-description (how to reach its media), a lease reply (where a request's pages sit) and a
put ticket (where the owner wants a put's bytes written). No bytes of a page ride in any of
them (a put of kind ``inline`` sends its layers in ``land`` calls, labelled as such).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from flatcake_ray.core.parts import LeasePart
from flatcake_ray.media.arena import ArenaChunk

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
    # The arena chunks the caller's tenant holds now (every chunk of an arena of one): the
    # only ones the node hands it (``hand_chunks``, to a process on the node's machine).
    arena_chunks: tuple[ArenaChunk, ...]
    arena_bytes: int
    pool_paths: tuple[str, ...]
    pool_file_bytes: int
    pool_direct: bool
    started_at: float  # wall clock; a changed value means the node restarted
    # NixlPeerInfo of the caller's tenant's arena chunks (none other), None without NIXL
    arena_nixl: Any = None
    ship_nixl: Any = None  # NixlPeerInfo of the ship (bounce) buffer
    nixl_reason: str | None = None  # why NIXL is unusable on that node
    rdma: bool = False  # the arena is exported for one-sided RDMA READs (accept_rdma)
    arena_rdma: tuple[Any, ...] = ()  # RdmaRegions (keys) of the caller's tenant's chunks alone
    verify_dram: bool = False  # readers check DRAM blocks too (SSD blocks always)
    gap_bytes: int = 64 << 10  # coalescing: holes smaller than this are read and dropped
    tenant: str = "default"  # whose geometry ``layers`` and ``page_bytes`` are
    # The node's process and start, as every PutTarget names them (a client's mappings of a
    # node's memory are this node's, never a restarted one's at the same offsets).
    owner: tuple[int, float] = (0, 0.0)


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
    # The DRAM scopes and their pages: what the coordinator counts lost if the node is.
    dram_scopes: int = 0
    dram_pages: int = 0

    @property
    def free_bytes(self) -> int:
        return max(0, self.dram_capacity - self.dram_used) + max(
            0, self.ssd_capacity - self.ssd_used
        )

    @classmethod
    def from_stats(
        cls, node_id: int, stats: Mapping[str, Any], dram_scopes: int = 0, dram_pages: int = 0
    ) -> NodeUsage:
        return cls(
            node_id,
            int(stats["dram_capacity"]),
            int(stats["dram_used"]),
            int(stats["ssd_capacity"]),
            int(stats["ssd_reserved"]),
            int(stats["scopes"]),
            int(stats["pages_indexed"]),
            dram_scopes,
            dram_pages,
        )


@dataclass(frozen=True)
class LeaseReply:
    """One node's answer to a lookup: its consecutive hits, pinned until released."""

    node_id: int
    lease_id: int
    hits: int
    parts: tuple[LeasePart, ...] = ()
    # The answering node's ``started_at`` (NodeDescription): a reader whose description of
    # the node has another one holds a restarted node's old mappings and must not read.
    epoch: float = 0.0

    @property
    def media(self) -> set[str]:
        return {part.medium.name for part in self.parts}


class PutMemory(Enum):
    """The memory a put's bytes go to (see :class:`PutTarget`)."""

    ARENA = "arena"
    LANDING = "landing"
    INLINE = "inline"  # LAST RESORT: in the ``land`` calls themselves
    NONE = "none"  # nothing to write


@dataclass(frozen=True)
class PutTarget:
    """Where a client writes a put's new pages, as the owner handed it out.

    ``memory``: ``ARENA`` (a DRAM put: layer ``n`` goes to ``offsets[n]`` of the owner's
    arena, in place), ``LANDING`` (an SSD put: layer ``n`` goes to slot
    ``offsets[n % len(offsets)]`` of the owner's landing area, then ``land``; with a slot per
    layer, landed at commit), ``INLINE`` (LAST RESORT, the landing area was full: each
    layer's bytes in its ``land`` call) or ``NONE`` (every key is stored already). A client
    on the owner's node maps the chunk of that memory at ``chunk_offset`` (``nbytes``; sent by
    ``hand_chunks``) shared and writable, the one chunk the put's pages or slots are in;
    one on another node WRITEs to ``peer`` over NIXL, and sends the checksums of what it
    wrote (``check_pages``).
    Only the put's new pages are written, in key order: ``new_positions`` of the put's keys.
    """

    memory: PutMemory
    offsets: tuple[int, ...]
    layer_bytes: int
    new_positions: np.ndarray = field(repr=False)
    nbytes: int = 0
    peer: Any = None
    chunk_offset: int = 0
    # (process id, start time) of the node that handed it out: a client maps a chunk once
    # per node process (a restarted node's chunks are new memory).
    owner: tuple[int, float] = (0, 0.0)
    # Pages per checksum block: a client that writes in place sends each layer's block
    # checksums with its land or commit call (``core/integrity.py`` ``block_checksums``).
    check_pages: int = 1


@dataclass(frozen=True)
class PutTicket:
    """A layer-wise put the owner planned and holds open (see ``StorageNode.begin_put``)."""

    put_id: int
    pages_new: int
    target: PutTarget
