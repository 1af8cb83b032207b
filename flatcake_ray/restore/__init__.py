"""The restore engine: one pipeline for every store (see ``pipeline.py``)."""

from flatcake_ray.restore.dest import Destination, LayerTensors, PagedPool
from flatcake_ray.restore.handle import RestoreHandle
from flatcake_ray.restore.pipeline import RestorePipeline
from flatcake_ray.restore.source import Leased, ReadOutcome, Source

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
