"""The handle a restore is waited on by: per-layer waits, the verified prefix, the outcome."""

from __future__ import annotations

import threading
from collections.abc import Callable

from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import RestoreError, RestoreTimeoutError, ShapeError
from flatcake_ray.restore.source import Leased, ReadOutcome

__all__ = ["RestoreHandle"]


class RestoreHandle:
    """One submitted restore; workers advance it, any thread may wait on it."""

    def __init__(self, request_id: int, layers: int, leased: Leased, medium: Medium, now: float):
        self.request_id = request_id
        self.layers = layers
        self.lease = leased  # what the restore reads; its token belongs to the source
        self.hits = leased.hits  # consecutive hits located at submit
        self.medium = medium  # slowest medium of the hits
        self.submitted_at = now  # the pipeline's clock
        self.started_at: float | None = None  # dispatched to a window or the DRAM lane
        self.finished_at: float | None = None
        self.outcome: ReadOutcome | None = None  # set when the restore ends
        self._cond = threading.Condition()
        self._layers_done = 0
        self._pages = leased.hits
        self._error: BaseException | None = None
        self._done = False

    @property
    def pages(self) -> int:
        """The verified prefix length: final once :attr:`done`."""
        return self._pages

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def done(self) -> bool:
        return self._done

    @property
    def layers_done(self) -> int:
        return self._layers_done

    def wait_for_layer(self, layer: int, timeout: float | None = None) -> int:
        """Block until ``layer`` is in place; returns the verified prefix so far."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.layers:
            raise ShapeError(f"layer must be an int in [0, {self.layers}), not {layer!r}")
        return self._wait(lambda: self._layers_done > layer, f"layer {layer}", timeout)

    def wait(self, timeout: float | None = None) -> int:
        """Block until the restore ended; returns the final verified prefix length."""
        return self._wait(lambda: self._done, "all layers", timeout)

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float | None) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: ready() or self._error is not None, timeout):
                raise RestoreTimeoutError(
                    f"restore {self.request_id}: {what} not in place after {timeout} s"
                )
            if self._error is not None:
                raise RestoreError(f"restore {self.request_id} failed: {self._error!r}") from (
                    self._error
                )
            return self._pages

    # ---- called by the pipeline's workers --------------------------------------------------
    def _start(self, now: float) -> None:
        self.started_at = now

    def _layer_done(self, layer: int) -> None:
        with self._cond:
            self._layers_done = layer + 1
            self._cond.notify_all()

    def _shrink(self, pages: int) -> None:
        with self._cond:
            self._pages = min(self._pages, pages)

    def _finish(self, now: float, error: BaseException | None, outcome: ReadOutcome) -> None:
        with self._cond:
            self.finished_at = now
            self.outcome = outcome
            self._error = error
            if error is None:
                self._layers_done = self.layers
            self._done = True
            self._cond.notify_all()
