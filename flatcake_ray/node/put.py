"""A put in progress, one layer at a time (see :meth:`FlatCakeStore.begin_put`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import ShapeError, StoreWriteError
from flatcake_ray.media.buffers import AlignedBuffer, as_layer_bytes

if TYPE_CHECKING:
    from flatcake_ray.core.catalog import PutPlan
    from flatcake_ray.node.store import FlatCakeStore


@dataclass(frozen=True)
class PutResult:
    pages_written: int
    pages_skipped: int  # already stored (write-once)
    medium: str | None  # "DRAM" or "SSD"; None when nothing was written
    rule: str | None  # the placement rule that chose the medium
    session_id: str | None


class PutHandle:
    """A put in progress: ``write_layer`` each layer once, then ``commit`` (or ``abort``).

    Used as a context manager, an exception inside aborts it, so a failed write publishes
    nothing and frees its space.
    """

    def __init__(self, store: FlatCakeStore, plan: PutPlan | None, keys: int) -> None:
        self._store = store
        self._plan = plan
        self._keys = keys
        self._written: set[int] = set()
        self._done = False
        self._staging = None
        if plan is not None:
            plan.segment.checksums = np.zeros(store.config.layers, dtype=np.uint64)
            if plan.segment.medium is Medium.SSD:
                self._staging = AlignedBuffer(plan.segment.layout.layer_stride)

    @property
    def pages_new(self) -> int:
        return 0 if self._plan is None else len(self._plan.new_positions)

    def write_layer(self, layer: int, pages: Any) -> None:
        if self._done:
            raise StoreWriteError("this put was already committed or aborted")
        config = self._store.config
        if not 0 <= layer < config.layers:
            raise ShapeError(f"layer {layer} outside 0..{config.layers - 1}")
        data = as_layer_bytes(pages, self._keys, config.page_bytes)
        if self._plan is None:
            return
        if layer in self._written:
            raise StoreWriteError(f"layer {layer} was already written")
        try:
            self._store._write_layer(self._plan, layer, data, self._staging)
        except OSError as exc:
            self.abort()
            raise StoreWriteError(f"writing layer {layer} failed: {exc}") from exc
        self._written.add(layer)

    def commit(self) -> PutResult:
        if self._done:
            raise StoreWriteError("this put was already committed or aborted")
        if self._plan is None:
            self._done = True
            return PutResult(0, self._keys, None, None, None)
        missing = sorted(set(range(self._store.config.layers)) - self._written)
        if missing:
            self.abort()
            raise StoreWriteError(f"commit before layers {missing[:8]} were written")
        try:
            result = self._store._commit(self._plan)
        except OSError as exc:
            self.abort()
            raise StoreWriteError(f"completing the write failed: {exc}") from exc
        self._finish()
        return PutResult(
            result.pages_written,
            self._keys - result.pages_written,
            result.medium,
            result.rule,
            result.session_id,
        )

    def abort(self) -> None:
        if self._done:
            return
        if self._plan is not None:
            self._store._abort(self._plan)
        self._finish()

    def _finish(self) -> None:
        self._done = True
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def __enter__(self) -> PutHandle:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if not self._done:
            self.abort()
