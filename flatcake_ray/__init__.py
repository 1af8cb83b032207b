"""FlatCake-Ray: a flat DRAM+SSD KV-cache store for LLM serving, on Ray.

The public surface (everything else is an implementation floor, see ``docs/architecture.md``):

- Stores, both a :class:`~flatcake_ray.core.api.KVStore`: :class:`FlatCakeStore` (in process)
  and :class:`FlatCakeClient` (the Ray service from any process of the cluster).
- Their configuration: :class:`StoreConfig`, :class:`ServiceConfig`, :class:`ClientConfig`,
  :class:`PlacementConfig`; put signals :class:`PutHints`; results :class:`PutResult`,
  :class:`Probe`.
- Restores: :class:`RestorePipeline`, :class:`RestoreHandle`, and the destinations
  :class:`PagedPool` and :class:`LayerTensors`.
- Keys and media: :class:`PageKey`, :class:`Medium`; typed errors in ``flatcake_ray.errors``.

Importing this package imports neither torch, CUDA, NIXL nor pyverbs: each name loads its
module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_WHERE = {
    "FlatCakeStore": "flatcake_ray.node.store",
    "FlatCakeClient": "flatcake_ray.client.client",
    "StoreConfig": "flatcake_ray.config",
    "ServiceConfig": "flatcake_ray.config",
    "ClientConfig": "flatcake_ray.config",
    "PlacementConfig": "flatcake_ray.config",
    "KVStore": "flatcake_ray.core.api",
    "PutResult": "flatcake_ray.core.api",
    "Probe": "flatcake_ray.core.api",
    "PutHints": "flatcake_ray.core.catalog",
    "PageKey": "flatcake_ray.core.keys",
    "Medium": "flatcake_ray.core.gva",
    "RestorePipeline": "flatcake_ray.restore.pipeline",
    "RestoreHandle": "flatcake_ray.restore.handle",
    "PagedPool": "flatcake_ray.restore.dest",
    "LayerTensors": "flatcake_ray.restore.dest",
}

__all__ = sorted([*_WHERE, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
