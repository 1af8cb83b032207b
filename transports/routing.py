"""Choose a page's transport from its GVA alone: the NodeID bits and the MediaType bits.

The choice needs no lookup and no call to the coordinator: a GVA is immutable, so its path is
too. ``available`` is the set of transport names whose ``probe()`` returned ``None`` on this
machine (and that the peer supports); the two local paths are always assumed available.

=============  ==========================================================================
where / what   transport, first available wins
=============  ==========================================================================
local DRAM     ``local-dram``
local SSD      ``local-ssd``
remote DRAM    ``remote-dram-rdma``, ``remote-dram-nixl``, ``object-store-fallback``
remote SSD     ``remote-ssd-nvmeof``, ``remote-ssd-shipped`` (the owner reads its SSD and
               ships the bytes over NIXL, so it needs ``remote-dram-nixl``),
               ``object-store-fallback``
=============  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Set

from flatcake_ray.core.gva import MAX_NODE_ID, Medium, decode
from flatcake_ray.errors import GVAError
from flatcake_ray.transports.base import (
    LOCAL_DRAM,
    LOCAL_SSD,
    OBJECT_STORE_FALLBACK,
    REMOTE_DRAM_NIXL,
    REMOTE_DRAM_RDMA,
    REMOTE_SSD_NVMEOF,
    REMOTE_SSD_SHIPPED,
)


def _remote_dram(available: Set[str]) -> str:
    if REMOTE_DRAM_RDMA in available:
        return REMOTE_DRAM_RDMA
    if REMOTE_DRAM_NIXL in available:
        return REMOTE_DRAM_NIXL
    return OBJECT_STORE_FALLBACK


def _remote_ssd(available: Set[str]) -> str:
    if REMOTE_SSD_NVMEOF in available:
        return REMOTE_SSD_NVMEOF
    if REMOTE_DRAM_NIXL in available:
        return REMOTE_SSD_SHIPPED
    return OBJECT_STORE_FALLBACK


def _check_node(local_node_id: int) -> None:
    if not 0 <= int(local_node_id) <= MAX_NODE_ID:
        raise GVAError(f"local node id {local_node_id} outside 0..{MAX_NODE_ID}")


def route(gva: int, local_node_id: int, available: Set[str]) -> str:
    """The transport name for one GVA; raises :class:`GVAError` for a malformed GVA."""
    _check_node(local_node_id)
    medium, node_id, _ = decode(gva)
    local = node_id == int(local_node_id)
    if medium is Medium.DRAM:
        return LOCAL_DRAM if local else _remote_dram(available)
    return LOCAL_SSD if local else _remote_ssd(available)
