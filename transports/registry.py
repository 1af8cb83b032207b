"""Transports by name, imported only when first asked for (NIXL, pyverbs and kvikio load
lazily: a process that never reads a remote page never imports them)."""

from __future__ import annotations

import importlib

from flatcake_ray.transports.base import (
    LOCAL_DRAM,
    LOCAL_SSD,
    LOCAL_SSD_GDS,
    OBJECT_STORE_FALLBACK,
    REMOTE_DRAM_NIXL,
    REMOTE_DRAM_RDMA,
    REMOTE_SSD_NVMEOF,
    REMOTE_SSD_SHIPPED,
    Transport,
)

_WHERE = {
    LOCAL_DRAM: ("local_dram", "LocalDramTransport"),
    LOCAL_SSD: ("local_ssd", "LocalSsdTransport"),
    LOCAL_SSD_GDS: ("local_ssd", "GdsSsdTransport"),
    REMOTE_DRAM_NIXL: ("nixl_dram", "NixlDramTransport"),
    REMOTE_DRAM_RDMA: ("rdma_verbs", "RdmaVerbsTransport"),
    REMOTE_SSD_NVMEOF: ("remote_ssd", "NvmeofSsdTransport"),
    REMOTE_SSD_SHIPPED: ("remote_ssd", "ShippedSsdTransport"),
    OBJECT_STORE_FALLBACK: ("object_store", "ObjectStoreTransport"),
}
KNOWN = frozenset(_WHERE)


def transport_class(name: str) -> type[Transport]:
    """The class of the transport named ``name``; ValueError listing the known names."""
    if name not in _WHERE:
        raise ValueError(f"no transport named {name!r}; known: {sorted(_WHERE)}")
    module, attribute = _WHERE[name]
    found = getattr(importlib.import_module(f"flatcake_ray.transports.{module}"), attribute)
    assert issubclass(found, Transport)
    return found
