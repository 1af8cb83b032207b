"""The vLLM worker's restore seam: how one request's stored prefix gets into its KV blocks.

The worker asks a :data:`RestoreFactory` for a :class:`LayerRestore` per load and calls its
``layer(l)`` before layer ``l``'s attention (``wait_for_layer_load``), or for every layer in
turn on a loader thread; ``layer(l)`` returns once layer ``l`` of the restored pages is in
vLLM's blocks. Two kinds:

- :class:`PipelinedRestore`: submits to the worker's :class:`RestorePipeline`, which streams
  the layers from SSD or DRAM straight into vLLM's per-layer KV tensors; ``layer(l)`` waits
  for that layer only, so attention on layer ``l`` overlaps the reads of later layers. The
  default for an in-process :class:`FlatCakeStore`.
- :class:`WholePrefixRestore`: ``store.get`` of every layer at once into host memory, then
  ``layer(l)`` copies layer ``l`` into the blocks. Any store (the Ray client has no pipeline).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from flatcake_ray.config import parse_size
from flatcake_ray.errors import ConfigError
from flatcake_ray.integrations._common import Geometry, KVStore
from flatcake_ray.restore.pipeline import LayerTensors, RestorePipeline

__all__ = [
    "LayerRestore",
    "LoadTarget",
    "PipelinedRestore",
    "RestoreFactory",
    "RestoreSettings",
    "WholePrefixRestore",
]


@dataclass(frozen=True)
class LoadTarget:
    """One load: ``keys`` from ``store`` into blocks ``block_ids`` (same order) of every
    layer of ``kv_caches`` (vLLM's registered tensors, ``[blocks, *page]``, one per layer)."""

    store: KVStore
    keys: Sequence[bytes]
    namespace: str
    geometry: Geometry
    kv_caches: Sequence[torch.Tensor]
    block_ids: Sequence[int]


class LayerRestore(Protocol):
    """One request's restore in progress.

    ``restored``: the prefix pages delivered; final once ``layer`` returned for every layer
    (a checksum failure in a later layer can still shrink it before then).
    """

    restored: int

    def layer(self, layer: int) -> None: ...  # returns once that layer's pages are in place


RestoreFactory = Callable[[LoadTarget], LayerRestore]


class WholePrefixRestore:
    """All layers at once with ``store.get``; each ``layer(l)`` copies one into the blocks."""

    def __init__(self, target: LoadTarget) -> None:
        geometry = target.geometry
        self._target = target
        self._pages = torch.empty(
            (geometry.layers, len(target.keys), geometry.page_bytes), dtype=torch.uint8
        )
        self.restored = target.store.get(list(target.keys), self._pages, namespace=target.namespace)

    def layer(self, layer: int) -> None:
        if not self.restored:
            return
        view = self._target.kv_caches[layer]
        block_ids = self._target.block_ids[: self.restored]
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=view.device)
        pages = self._pages[layer, : self.restored].to(view.device, non_blocking=True)
        view[ids] = pages.view(self.restored, *view.shape[1:])


class PipelinedRestore:
    """A restore submitted to a :class:`RestorePipeline`; ``layer(l)`` waits for layer ``l``.

    ``timeout`` bounds each wait (seconds); a restore that does not finish raises
    :class:`~flatcake_ray.errors.RestoreTimeoutError`, one that failed ``RestoreError``.
    """

    def __init__(self, pipeline: RestorePipeline, target: LoadTarget, *, timeout: float) -> None:
        dest = LayerTensors(target.kv_caches, target.block_ids[: len(target.keys)])
        self.handle = pipeline.submit(list(target.keys), dest, namespace=target.namespace)
        self.restored = self.handle.hits
        self.waited: list[int] = []  # layers waited for, in order (tests, diagnostics)
        self._timeout = timeout

    def layer(self, layer: int) -> None:
        self.restored = self.handle.wait_for_layer(layer, self._timeout)
        self.waited.append(layer)


@dataclass(frozen=True)
class RestoreSettings:
    """The worker's restore options (``kv_connector_extra_config``):

    ``restore_pipeline``: ``auto`` (pipelined where the store is an in-process FlatCakeStore)
    or ``off``; ``restore_windows``, ``restore_slot_bytes``: the pipeline's SSD windows and
    staging slot size; ``load_timeout_s``: the longest a layer waits for its pages.
    """

    pipeline: str = "auto"
    windows: int = 2
    slot_bytes: int | None = None
    load_timeout_s: float = 300.0

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> RestoreSettings:
        pipeline = str(options.get("restore_pipeline", cls.pipeline))
        if pipeline not in ("auto", "off"):
            raise ConfigError(f"restore_pipeline must be 'auto' or 'off', not {pipeline!r}")
        slot_bytes = options.get("restore_slot_bytes")
        timeout = float(options.get("load_timeout_s", cls.load_timeout_s))
        if not timeout > 0:
            raise ConfigError(f"load_timeout_s must be > 0, not {timeout!r}")
        return cls(
            pipeline=pipeline,
            windows=int(options.get("restore_windows", cls.windows)),
            slot_bytes=None if slot_bytes is None else parse_size(slot_bytes),
            load_timeout_s=timeout,
        )
