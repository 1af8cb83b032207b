"""The vLLM worker's loads: one request's stored prefix into its KV blocks, layer by layer.

Every store restores through the same pipeline (``KVStore.restore``): the worker submits a
:class:`LoadTarget` and gets a :class:`PipelinedRestore`, whose ``layer(l)`` returns once layer
``l`` of the restored pages is in vLLM's blocks, so attention on layer ``l`` overlaps the reads
of later layers. An asynchronous (SSD) load calls it for every layer in turn on a loader
thread; that is the same restore with nobody waiting between layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flatcake_ray.core.api import KVStore
from flatcake_ray.errors import ConfigError
from flatcake_ray.integrations._common import Geometry
from flatcake_ray.restore.dest import LayerTensors

__all__ = ["LoadTarget", "PipelinedRestore", "RestoreSettings"]


@dataclass(frozen=True)
class LoadTarget:
    """One load: ``keys`` from ``store`` into blocks ``block_ids`` (same order) of every
    layer of ``kv_caches`` (vLLM's registered tensors, ``[blocks, *page]``, one per layer),
    under ``grant`` where the scheduler's lookup leased them (``KVStore.probe``)."""

    store: KVStore
    keys: Sequence[bytes]
    namespace: str
    geometry: Geometry
    kv_caches: Sequence[torch.Tensor]
    block_ids: Sequence[int]
    grant: Any = None


class PipelinedRestore:
    """A restore of one load; ``layer(l)`` waits for layer ``l``.

    ``restored``: the prefix pages delivered; final once ``layer`` returned for every layer
    (a checksum failure in a later layer can still shrink it before then). ``timeout`` bounds
    each wait (seconds); a restore that does not finish raises
    :class:`~flatcake_ray.errors.RestoreTimeoutError`, one that failed ``RestoreError``.
    """

    def __init__(self, target: LoadTarget, *, timeout: float) -> None:
        dest = LayerTensors(target.kv_caches, target.block_ids[: len(target.keys)])
        keys, namespace = list(target.keys), target.namespace
        self.handle = target.store.restore(keys, dest, namespace=namespace, grant=target.grant)
        self.restored = self.handle.hits
        self.waited: list[int] = []  # layers waited for, in order (tests, diagnostics)
        self._timeout = timeout

    def layer(self, layer: int) -> None:
        self.restored = self.handle.wait_for_layer(layer, self._timeout)
        self.waited.append(layer)

    def finish(self) -> None:
        """Wait for the whole restore to end: every layer in place, the lease released and
        the reads counted (the last layer can be in place a moment before that)."""
        self.restored = self.handle.wait(self._timeout)


@dataclass(frozen=True)
class RestoreSettings:
    """The worker's restore options (``kv_connector_extra_config``): ``load_timeout_s``, the
    longest a layer waits for its pages; ``idle_wait_s``, the longest a step that scheduled
    no tokens blocks on the async loads in flight before vLLM steps again (it returns as
    soon as one is done; see ``WorkerSide.finished_loads``). The pipeline's own knobs
    (windows, slot bytes) are the store's: ``store_restore_windows`` and so on."""

    load_timeout_s: float = 300.0
    idle_wait_s: float = 0.01

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> RestoreSettings:
        timeout = float(options.get("load_timeout_s", cls.load_timeout_s))
        if not timeout > 0:
            raise ConfigError(f"load_timeout_s must be > 0, not {timeout!r}")
        idle_wait = float(options.get("idle_wait_s", cls.idle_wait_s))
        if not idle_wait >= 0:
            raise ConfigError(f"idle_wait_s must be >= 0, not {idle_wait!r}")
        return cls(load_timeout_s=timeout, idle_wait_s=idle_wait)
