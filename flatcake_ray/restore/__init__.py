"""The restore engine: one pipeline for every store (see ``pipeline.py``).

The names below resolve on first access: a module that needs only the source contract
(``restore/source.py``, what a storage node implements) loads no torch with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flatcake_ray.restore.dest import Destination, LayerTensors, PagedPool
    from flatcake_ray.restore.handle import RestoreHandle
    from flatcake_ray.restore.pipeline import RestorePipeline
    from flatcake_ray.restore.source import Leased, ReadOutcome, Source

_HOMES = {
    "Destination": "dest",
    "LayerTensors": "dest",
    "PagedPool": "dest",
    "RestoreHandle": "handle",
    "RestorePipeline": "pipeline",
    "Leased": "source",
    "ReadOutcome": "source",
    "Source": "source",
}

__all__ = [
    "Destination",
    "LayerTensors",
    "Leased",
    "PagedPool",
    "ReadOutcome",
    "RestoreHandle",
    "RestorePipeline",
    "Source",
]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
