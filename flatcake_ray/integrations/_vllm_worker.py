"""Worker side of the vLLM connector: moves pages between vLLM's paged KV and the store.

vLLM hands each worker one tensor per attention layer, viewed ``[num_blocks, H, N, C]``
(block first, whatever the physical layout). One store page is one vLLM block of one layer,
stored as the bytes of ``tensor[block]`` in that logical order, so a page saved under one
physical layout restores under another.

Loads go through the store's restore pipeline, whatever the store (in process or the Ray
service): a :class:`PipelinedRestore` per load, whose ``layer(l)`` returns once layer ``l`` is
in vLLM's blocks, so ``wait_for_layer_load`` waits for one layer while later layers stream
in. Saves go layer by layer through the store's ``begin_put`` as ``save_kv_layer`` hands
each layer over; ``wait_for_save`` commits them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from flatcake_ray.core.api import KVStore, PutWriter
from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import FlatCakeError, ShapeError
from flatcake_ray.integrations._common import Geometry, byte_view, warm_up
from flatcake_ray.integrations._vllm_restore import (
    LoadTarget,
    PipelinedRestore,
    RestoreSettings,
)
from flatcake_ray.integrations._vllm_scheduler import LoadSpec, SaveSpec, StepPlan

__all__ = ["WorkerSide"]

logger = logging.getLogger(__name__)


class _PendingLoad:
    def __init__(self, spec: LoadSpec, restore: PipelinedRestore, layers: int) -> None:
        self.spec = spec
        self.restore = restore
        self.layers_left = set(range(layers))


class WorkerSide:
    """State of one vLLM worker (one tensor-parallel rank)."""

    def __init__(
        self,
        store: KVStore,
        *,
        layer_names: Sequence[str],
        namespace: str,
        is_writer: bool,
        restore_settings: RestoreSettings | None = None,
    ) -> None:
        self.store = store
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.namespace = namespace
        self.is_writer = is_writer
        self.restore_settings = restore_settings or RestoreSettings()
        self._views: list[torch.Tensor] = []
        self.geometry: Geometry | None = None
        self._step: StepPlan | None = None
        self._idle_step = False  # the step being finished scheduled no tokens
        self._sync_loads: list[_PendingLoad] = []
        self._open_saves: dict[int, tuple[SaveSpec, PutWriter, set[int]]] = {}
        self._failed_saves: set[int] = set()
        self._async_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="flatcake-load")
        self._async_loads: dict[str, tuple[LoadSpec, Future[list[int]]]] = {}
        self._failed_lock = threading.Lock()
        self._failed_blocks: set[int] = set()
        # (announcement, medium) of committed saves the connector has not yet reported
        self.committed: list[tuple[Any, Medium | None]] = []
        self.counters = dict.fromkeys(
            ("loaded_pages", "saved_pages", "failed_pages", "failed_saves", "pipelined_loads"), 0
        )

    # ---- registration ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> Geometry:
        found: dict[int, torch.Tensor] = {}
        for name, tensor in kv_caches.items():
            index = self.layer_index.get(name)
            if index is not None:  # layers that reuse another layer's KV are not listed
                found[index] = byte_view(tensor)
        missing = [name for name, i in self.layer_index.items() if i not in found]
        if missing:
            raise ShapeError(f"vLLM registered no KV tensor for layers {missing[:4]}")
        views = [found[i] for i in range(len(self.layer_index))]
        shapes = {tuple(view.shape[1:]) for view in views}
        if len(shapes) != 1:
            raise ShapeError(f"attention layers differ in page shape: {sorted(shapes)}")
        self._views = views
        page_bytes = int(torch.Size(shapes.pop()).numel())
        self.geometry = Geometry(len(views), page_bytes)
        # As the engine starts, not in its first forward: the Ray client maps its node's
        # arena (a first save into a chunk of 4 KiB pages filled its page tables: 70-140 ms
        # a 1.2 GB chunk, inside a step).
        warm_up(self.store)
        return self.geometry

    def _ids(self, block_ids: Sequence[int], layer: int) -> torch.Tensor:
        return torch.as_tensor(block_ids, dtype=torch.long, device=self._views[layer].device)

    def _gather(self, layer: int, block_ids: Sequence[int]) -> torch.Tensor:
        pages = self._views[layer][self._ids(block_ids, layer)]
        return pages.reshape(len(block_ids), -1).cpu()

    # ---- one step --------------------------------------------------------------------------
    def start_step(self, plan: StepPlan) -> None:
        """The step's plan arrives before the forward, so saves can follow it layer by layer
        even when vLLM starts this step's loads only after the forward."""
        self._step = plan
        self._idle_step = plan.idle

    def start_loads(self) -> None:
        if self._step is None:
            return
        for spec in self._step.loads:
            if spec.is_async:
                future = self._async_pool.submit(self._load_all, spec)
                self._async_loads[spec.req_id] = (spec, future)
            else:
                self._start_sync_load(spec)

    def _start_sync_load(self, spec: LoadSpec) -> None:
        """A store error fails this request's blocks (vLLM recomputes them or fails the
        request, per kv_load_failure_policy), not the whole step; it is logged in full."""
        try:
            self._sync_loads.append(self._begin_load(spec))
        except FlatCakeError:
            logger.warning("FlatCake load for %s failed", spec.req_id, exc_info=True)
            with self._failed_lock:
                self.counters["failed_pages"] += len(spec.block_ids)
                self._failed_blocks.update(spec.block_ids)

    def _begin_load(self, spec: LoadSpec) -> _PendingLoad:
        assert self.geometry is not None
        namespace = self.namespace + spec.tenant
        grant = dict(spec.grants).get(namespace)  # this shard's lease, if the lookup took it
        target = LoadTarget(
            self.store, spec.keys, namespace, self.geometry, self._views, spec.block_ids, grant
        )
        restore = PipelinedRestore(target, timeout=self.restore_settings.load_timeout_s)
        with self._failed_lock:  # async loads count from the loader threads
            self.counters["pipelined_loads"] += 1
        return _PendingLoad(spec, restore, self.geometry.layers)

    def _note_shortfall(self, spec: LoadSpec, restored: int) -> None:
        """Blocks the store could not deliver (reclaimed, corrupt) go back to vLLM, which
        recomputes them or fails the request, per its kv_load_failure_policy."""
        missing = spec.block_ids[restored:]
        with self._failed_lock:  # async loads report from the loader threads
            self.counters["loaded_pages"] += restored
            self.counters["failed_pages"] += len(missing)
            self._failed_blocks.update(missing)

    def _load_all(self, spec: LoadSpec) -> list[int]:
        """An async load is reported done once its restore has ended, not just once its last
        layer is in place: vLLM may go on at once (the idle-step wait wakes it), and what the
        store counted for the load must be counted by then."""
        pending = self._begin_load(spec)
        pending.restore.finish()
        for layer in sorted(pending.layers_left):
            self._place_layer(pending, layer)
        return list(spec.block_ids[: pending.restore.restored])

    def _place_layer(self, pending: _PendingLoad, layer: int) -> None:
        """Wait until ``layer`` of the load is in vLLM's blocks; once every layer is, the
        restored count is final and the shortfall is reported."""
        if layer not in pending.layers_left:
            return
        pending.layers_left.discard(layer)
        pending.restore.layer(layer)
        if not pending.layers_left:
            self._note_shortfall(pending.spec, pending.restore.restored)

    def _place_sync_layer(self, pending: _PendingLoad, layer: int) -> None:
        """A failed or stalled restore fails this request's blocks (vLLM recomputes them or
        fails the request), not the forward; the error is logged in full."""
        try:
            self._place_layer(pending, layer)
        except FlatCakeError:
            logger.warning("FlatCake load for %s failed", pending.spec.req_id, exc_info=True)
            pending.layers_left.clear()
            with self._failed_lock:
                self.counters["failed_pages"] += len(pending.spec.block_ids)
                self._failed_blocks.update(pending.spec.block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        for pending in self._sync_loads:
            self._place_sync_layer(pending, layer)

    def save_kv_layer(self, layer_name: str) -> None:
        layer = self.layer_index.get(layer_name)
        if layer is None or self._step is None or not self.is_writer:
            return
        for index, spec in enumerate(self._step.saves):
            self._write_layer(index, spec, layer)

    def _write_layer(self, index: int, spec: SaveSpec, layer: int) -> None:
        if index in self._failed_saves:
            return
        try:
            entry = self._open_saves.get(index) or self._open_save(index, spec)
            _, handle, written = entry
            if layer not in written:
                handle.write_layer(layer, self._gather(layer, spec.block_ids))
                written.add(layer)
        except FlatCakeError:
            self._give_up_save(index, spec)

    def _open_save(self, index: int, spec: SaveSpec) -> tuple[SaveSpec, PutWriter, set[int]]:
        handle = self.store.begin_put(
            list(spec.keys),
            namespace=self.namespace + spec.tenant,
            session_id=spec.session_id,
            parent=spec.parent,
            hints=spec.hints,
        )
        entry: tuple[SaveSpec, PutWriter, set[int]] = (spec, handle, set())
        self._open_saves[index] = entry
        return entry

    def _give_up_save(self, index: int, spec: SaveSpec) -> None:
        """A cache that cannot store (medium full, write failed) serves on without it: the
        pages become a future miss. The store's error is logged with its traceback."""
        logger.warning(
            "FlatCake save of %d pages for %s failed", len(spec.keys), spec.req_id, exc_info=True
        )
        self.counters["failed_saves"] += 1
        self._failed_saves.add(index)
        entry = self._open_saves.pop(index, None)
        if entry is not None:
            entry[1].abort()

    def finish_step(self) -> None:
        """End of the step: scatter any layer no attention call asked for, write any layer no
        save call delivered (the forward has run, so the blocks hold this step's KV), commit."""
        for pending in self._sync_loads:
            for layer in sorted(pending.layers_left):
                self._place_sync_layer(pending, layer)
        self._sync_loads.clear()
        if self._step is not None and self.is_writer:
            assert self.geometry is not None
            for index, spec in enumerate(self._step.saves):
                for layer in range(self.geometry.layers):
                    self._write_layer(index, spec, layer)
        for index in sorted(self._open_saves):
            spec, handle, _ = self._open_saves[index]
            try:
                result = handle.commit()
                self.counters["saved_pages"] += len(spec.keys)
                if spec.announce is not None:
                    self.committed.append((spec.announce, result.medium))
            except FlatCakeError:
                self._give_up_save(index, spec)
        self._open_saves.clear()
        self._failed_saves.clear()
        self._step = None

    # ---- completions -----------------------------------------------------------------------
    def finished_loads(self) -> set[str]:
        """Async loads that are done. A failed one is reported done with its blocks marked
        failed, as vLLM requires; its exception is logged with the traceback.

        After a step that scheduled no tokens, this first waits (up to ``idle_wait_s``) for
        a load in flight to finish. vLLM would otherwise call again at once, step after empty
        step, and that busy loop holds the GIL the loader threads need between their copies:
        measured on CPU, it stretched a DRAM hit's load from milliseconds to 0.2-0.5 s. A
        blocked wait releases the GIL, and wakes as soon as the load is done; the bound only
        keeps a new request's admission from waiting behind a long SSD load.
        """
        idle, self._idle_step = self._idle_step, False
        if idle and self._async_loads:
            futures = [future for _, future in self._async_loads.values()]
            wait(futures, timeout=self.restore_settings.idle_wait_s, return_when=FIRST_COMPLETED)
        done: set[str] = set()
        for req_id, (spec, future) in list(self._async_loads.items()):
            if not future.done():
                continue
            del self._async_loads[req_id]
            done.add(req_id)
            error = future.exception()
            if error is not None:
                logger.error("FlatCake load for %s failed", req_id, exc_info=error)
                with self._failed_lock:
                    self._failed_blocks.update(spec.block_ids)
        return done

    def take_failed_blocks(self) -> set[int]:
        with self._failed_lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_async_loads(self, timeout: float | None = None) -> None:
        """Block until every async load in flight is done (tests, shutdown)."""
        for _, future in list(self._async_loads.values()):
            future.exception(timeout=timeout)

    def shutdown(self) -> None:
        """Async loads finish first (they wait on the store's pipeline)."""
        self._async_pool.shutdown(wait=True)
