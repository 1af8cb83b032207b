"""A put in progress on a node's store, a layer (or a piece of one) at a time.

The one put path of the store: ``FlatCakeStore.put`` and ``begin_put`` use it in process, and
a storage node uses it for the Ray client's layer-wise puts (``write_pages`` with the pieces a
client sends). Used as a context manager, an exception inside aborts it, so a failed write
publishes nothing and frees its space. A handle left open past its deadline is aborted by its
owner (a storage node expires the handles of clients that went away).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from flatcake_ray.core.api import PutResult
from flatcake_ray.core.catalog import Catalog, PutPlan
from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import ShapeError, StoreWriteError
from flatcake_ray.media.buffers import as_layer_bytes
from flatcake_ray.node.puts import PutTable
from flatcake_ray.node.writer import SegmentWriter


class PutHandle:
    """``write_layer`` each layer once (or ``write_pages`` pieces covering it), then
    ``commit`` (or ``abort``)."""

    def __init__(
        self,
        writer: SegmentWriter,
        plan: PutPlan | None,
        catalog: Catalog,
        keys: int,
        table: PutTable[PutHandle],
        on_commit: Callable[[PutResult, str], None] | None = None,
    ) -> None:
        self._writer = writer
        self._on_commit = on_commit  # the store's metrics: (result, route)
        self.route = "in-process"  # how the bytes reach the store (a storage node says)
        self._state = writer.start(plan, catalog, keys) if plan is not None else None
        self._keys = keys
        self._layers, self._page_bytes = catalog.config.layers, catalog.config.page_bytes
        self.tenant = catalog.tenant
        self._done = False
        # One writer at a time, and never alongside an abort (an expiry from another thread):
        # a write into space already given back would land in someone else's segment.
        self._lock = threading.Lock()
        self._table = table
        self.on_done: Callable[[], None] | None = None  # called once, when the put is over
        self.slots: tuple[int, ...] = ()  # the owner's landing slots for this put's layers
        self.put_id = table.add(self)

    @property
    def pages_new(self) -> int:
        return 0 if self._state is None else self._state.pages_new

    @property
    def done(self) -> bool:
        return self._done

    @property
    def medium(self) -> Medium | None:
        """Where the new pages go (None: every key was stored already)."""
        return None if self._state is None else self._state.plan.segment.medium

    @property
    def new_positions(self) -> np.ndarray:
        """Which of the put's keys are written (in order); the rest were stored already."""
        if self._state is None:
            return np.zeros(0, dtype=np.int64)
        return np.asarray(self._state.plan.new_positions, dtype=np.int64)

    @property
    def layers(self) -> int:
        return self._layers

    @property
    def layer_bytes(self) -> int:
        return self.pages_new * self._page_bytes

    @property
    def layer_stride(self) -> int:
        return 0 if self._state is None else self._state.plan.segment.layout.layer_stride

    def arena_offsets(self) -> tuple[int, ...]:
        """Per layer, where its new pages go in the DRAM arena (a DRAM put only)."""
        assert self._state is not None and self.medium is Medium.DRAM
        return tuple(self._writer.layer_extent(self._state, n) for n in range(self._layers))

    def land_layer(
        self, layer: int, source: np.ndarray | None, sums: np.ndarray | None = None
    ) -> None:
        """Layer ``layer``'s new pages are complete: in place in the arena (``source`` None,
        a DRAM put) or in ``source`` (``layer_bytes`` bytes; for SSD an aligned buffer of
        ``layer_stride``); ``sums``: the checksums its writer computed (``SegmentWriter``).
        A failure aborts the put."""
        with self._lock:
            self._land_layer(layer, source, sums)
        self._table.touch(self.put_id)

    @property
    def check_pages(self) -> int:
        """Pages per checksum block of the put's segment (a writer's ``sums`` are per block)."""
        return 1 if self._state is None else self._state.plan.segment.layout.check_pages

    def _land_layer(self, layer: int, source: np.ndarray | None, sums: np.ndarray | None) -> None:
        self._check_live()
        if not isinstance(layer, int) or not 0 <= layer < self._layers:
            raise ShapeError(f"layer {layer!r} outside 0..{self._layers - 1}")
        if self._state is None:
            return
        if self._state.received[layer]:
            raise StoreWriteError(f"layer {layer} was already written")
        if source is None and self.medium is not Medium.DRAM:
            raise StoreWriteError("only a DRAM put lands in place")
        if source is not None and source.nbytes < self.layer_bytes:
            raise ShapeError(f"layer {layer}: {source.nbytes} bytes, want {self.layer_bytes}")
        try:
            self._writer.land_layer(self._state, layer, source, sums)
        except OSError as exc:
            self._abort()
            raise StoreWriteError(f"writing layer {layer} failed: {exc}") from exc

    def write_layer(self, layer: int, pages: Any) -> None:
        """``pages``: ``[keys, page_elems]`` (numpy or torch) of one layer, every key's page."""
        self.write_pages(layer, 0, as_layer_bytes(pages, self._keys, self._page_bytes))

    def write_pages(self, layer: int, first: int, pages: np.ndarray) -> None:
        """uint8 ``[n, page_bytes]`` pages of keys ``[first, first + n)`` of ``layer``."""
        with self._lock:
            self._write_pages(layer, first, pages)
        self._table.touch(self.put_id)

    def _write_pages(self, layer: int, first: int, pages: np.ndarray) -> None:
        self._check_live()
        if not isinstance(layer, int) or not 0 <= layer < self._layers:
            raise ShapeError(f"layer {layer!r} outside 0..{self._layers - 1}")
        if pages.ndim != 2 or pages.shape[1] != self._page_bytes or pages.dtype != np.uint8:
            raise ShapeError(f"pages must be uint8 [n, {self._page_bytes}], got {pages.shape}")
        if not 0 <= first <= first + len(pages) <= self._keys:
            raise ShapeError(f"pages [{first}, {first + len(pages)}) outside the put's keys")
        if self._state is None:
            return
        if self._state.received[layer] >= self._state.pages_new:
            raise StoreWriteError(f"layer {layer} was already written")
        try:
            self._writer.write_pages(self._state, layer, first, pages)
        except OSError as exc:
            self._abort()
            raise StoreWriteError(f"writing layer {layer} failed: {exc}") from exc

    def commit(self) -> PutResult:
        try:
            with self._lock:
                result = self._commit()
        finally:
            self._finished()
        if self._on_commit is not None:
            self._on_commit(result, self.route)
        return result

    def _commit(self) -> PutResult:
        self._check_live()
        if self._state is None:
            self._done = True
            return PutResult(0, self._keys, None, None, None)
        missing = self._state.layers_missing()
        if missing:
            self._abort()
            raise StoreWriteError(f"commit before layers {missing[:8]} were written")
        try:
            published = self._writer.commit(self._state)
        except OSError as exc:
            self._abort()
            raise StoreWriteError(f"completing the write failed: {exc}") from exc
        self._done = True
        plan = self._state.plan
        written = int(published.sum())
        return PutResult(
            written, self._keys - written, plan.segment.medium, plan.rule, plan.session_id
        )

    def abort(self) -> None:
        with self._lock:
            self._abort()
        self._finished()

    def _finished(self) -> None:
        """Once the put is over: nothing left to expire; its owner's extras (a landing slot)
        go back."""
        if not self._done:
            return
        self._table.forget(self.put_id)
        on_done, self.on_done = self.on_done, None
        if on_done is not None:
            on_done()

    def _abort(self) -> None:
        if self._done:
            return
        self._done = True
        if self._state is not None:
            self._writer.abort(self._state)

    def _check_live(self) -> None:
        if self._done:
            raise StoreWriteError("this put was already committed, aborted or expired")

    def __enter__(self) -> PutHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()
