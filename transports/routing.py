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

import operator
from collections.abc import Set

import numpy as np

from flatcake_ray.core.gva import MAX_NODE_ID, MEDIA_SHIFT, NODE_SHIFT, Medium, decode
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


def route_many(gvas: np.ndarray, local_node_id: int, available: Set[str]) -> dict[str, np.ndarray]:
    """Group a request's pages by transport: name -> int64 indices into ``gvas`` (ascending).

    Same answer as ``route`` on each element, in a few vectorised bit operations. Only the
    paths that occur are keys. Raises :class:`GVAError` if any GVA has a reserved medium.
    """
    _check_node(local_node_id)
    words = _as_uint64(gvas)
    media = words >> np.uint64(MEDIA_SHIFT)
    if np.any(media > np.uint64(Medium.SSD)):
        bad = int(words[np.argmax(media > np.uint64(Medium.SSD))])
        raise GVAError(f"GVA {bad:#x} has reserved medium {bad >> MEDIA_SHIFT}")
    nodes = (words >> np.uint64(NODE_SHIFT)) & np.uint64(MAX_NODE_ID)
    local = nodes == np.uint64(local_node_id)
    ssd = media == np.uint64(Medium.SSD)
    groups = {
        LOCAL_DRAM: local & ~ssd,
        LOCAL_SSD: local & ssd,
        _remote_dram(available): ~local & ~ssd,
    }
    remote_ssd_path = _remote_ssd(available)
    remote_ssd = ~local & ssd
    if remote_ssd_path in groups:  # both remote media fell back to the object store
        groups[remote_ssd_path] = groups[remote_ssd_path] | remote_ssd
    else:
        groups[remote_ssd_path] = remote_ssd
    return {path: np.flatnonzero(mask) for path, mask in groups.items() if mask.any()}


def _as_uint64(gvas: np.ndarray) -> np.ndarray:
    if not isinstance(gvas, np.ndarray):
        # Via Python ints: numpy would turn a list mixing values >= 2**63 with small ones
        # into float64 and lose the low bits.
        try:
            return np.array([operator.index(g) for g in gvas], dtype=np.uint64)
        except (OverflowError, TypeError, ValueError) as exc:
            raise GVAError("gvas must be 64-bit unsigned integers") from exc
    if gvas.ndim != 1:
        raise GVAError(f"gvas must be 1-D, got shape {gvas.shape}")
    if gvas.dtype == np.uint64 or gvas.size == 0:
        return gvas.astype(np.uint64, copy=False)
    if gvas.dtype == object:
        return _as_uint64(gvas.tolist())
    if not np.issubdtype(gvas.dtype, np.integer):
        raise GVAError(f"gvas must be unsigned 64-bit integers, got dtype {gvas.dtype}")
    if gvas.min() < 0:
        raise GVAError("a GVA is negative")
    return gvas.astype(np.uint64)
