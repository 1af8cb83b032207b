"""The staging windows of the restore pipeline, and the handle a restore is waited on by.

A :class:`Lane` is one bounded window: ``slot_layers`` :class:`Slot` s, a reader thread that
fills free slots with a restore's chunks in order (``LayerStager.fill``; O_DIRECT, the GIL is
released while the drive works) and a scatter thread that empties them in order through the
pipeline's ``deliver`` callback, so the reads of layer ``l + 1`` are in flight while layer ``l``
is scattered. A lane runs one restore (:class:`Job`) at a time; the reader blocks while every
slot is taken, which is the whole memory bound. Exceptions on either thread end up on the job
and are raised by :meth:`RestoreHandle.wait`. ``restore.py`` owns the lanes and the contract.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flatcake_ray.core.catalog import Lease
from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import RestoreError, RestoreTimeoutError, ShapeError
from flatcake_ray.restore.dest import Destination
from flatcake_ray.restore.plan import LayerStager

__all__ = ["Gauge", "Job", "Lane", "RestoreHandle", "Slot"]

_END = object()  # reader -> scatter: the job has no more chunks


class RestoreHandle:
    """One submitted restore; workers advance it, any thread may wait on it."""

    def __init__(self, request_id: int, layers: int, hits: int, medium: Medium, now: float):
        self.request_id = request_id
        self.layers = layers
        self.hits = hits  # consecutive hits located at submit
        self.medium = medium  # slowest medium of the hits
        self.submitted_at = now  # the pipeline's clock
        self.started_at: float | None = None  # dispatched to a window or the DRAM lane
        self.finished_at: float | None = None
        self._cond = threading.Condition()
        self._layers_done = 0
        self._pages = hits
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
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.layers:
            raise ShapeError(f"layer must be an int in [0, {self.layers}), not {layer!r}")
        return self._wait(lambda: self._layers_done > layer, f"layer {layer}", timeout)

    def wait(self, timeout: float | None = None) -> int:
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

    def _finish(self, now: float, error: BaseException | None) -> None:
        with self._cond:
            self.finished_at = now
            self._error = error
            if error is None:
                self._layers_done = self.layers
            self._done = True
            self._cond.notify_all()


@dataclass
class Job:
    handle: RestoreHandle
    lease: Lease
    stager: LayerStager
    dest: Destination
    dispatched: bool = False  # handed to a lane, which finishes it; under the pipeline's lock
    bad_scopes: set[int] = field(default_factory=set)
    ssd_commands: int = 0  # written by the reader thread only
    ssd_bytes: int = 0
    dram_bytes: int = 0  # written by the scatter thread only
    error: BaseException | None = None


@dataclass
class Slot:
    host: np.ndarray | None  # aligned bytes the drive reads into (SSD windows only)
    device: torch.Tensor | None  # HBM twin when the destination is on a GPU
    stream: Any  # the window's torch.cuda.Stream, or None
    nbytes: int  # memory this slot holds, host and device


class Gauge:
    """Staging bytes held by chunks in flight, and the most ever held at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0
        self.high_water = 0

    def take(self, nbytes: int) -> None:
        with self._lock:
            self.held += nbytes
            self.high_water = max(self.high_water, self.held)

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes


class Lane:
    """One staging window: a reader thread fills its slots in order, a scatter thread empties
    them in order; one job at a time. ``deliver(job, chunk, slot)`` and ``finish(lane, job)``
    run on the scatter thread. With ``overlap=False`` (the DRAM lane: there is no drive to
    wait for) one thread does both, so a chunk costs no thread handoff."""

    def __init__(
        self, name: str, slots: list[Slot], gauge: Gauge, deliver, finish, *, overlap: bool = True
    ) -> None:
        self.slots = slots
        self._gauge, self._deliver, self._finish = gauge, deliver, finish
        self._overlap = overlap
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._handoff: queue.SimpleQueue = queue.SimpleQueue()
        for slot in slots:
            self._free.put(slot)
        self._threads = [threading.Thread(target=self._read_loop, name=f"{name}-read", daemon=True)]
        if overlap:
            self._threads.append(
                threading.Thread(target=self._scatter_loop, name=f"{name}-scatter", daemon=True)
            )
        for thread in self._threads:
            thread.start()

    def start(self, job: Job) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)
        for thread in self._threads:
            thread.join()

    def _read_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._stage(job)
                end = _END
            except BaseException as exc:  # handed to the scatter side, raised by wait()
                end = exc
            # Exactly one end per job, outside the try: finishing twice would count it out twice.
            self._emit(job, end, None)
        self._handoff.put(None)

    def _stage(self, job: Job) -> None:
        for layer in range(job.handle.layers):
            for chunk in job.stager.chunks(layer):
                if job.error is not None:
                    return  # the scatter side failed: stop reading, finish with its error
                slot = self._free.get()  # blocks while every slot is in use: the bound
                self._gauge.take(slot.nbytes)
                try:
                    if chunk.reads:
                        job.stager.fill(chunk, slot.host)
                        job.ssd_commands += len(chunk.reads)
                        job.ssd_bytes += sum(read.length for read in chunk.reads)
                except BaseException:
                    self._give(slot)
                    raise
                self._emit(job, chunk, slot)

    def _emit(self, job: Job, chunk, slot: Slot | None) -> None:
        if self._overlap:
            self._handoff.put((job, chunk, slot))
        else:
            self._consume(job, chunk, slot)

    def _scatter_loop(self) -> None:
        while (item := self._handoff.get()) is not None:
            self._consume(*item)

    def _consume(self, job: Job, chunk, slot: Slot | None) -> None:
        if chunk is _END or isinstance(chunk, BaseException):
            job.error = job.error or (None if chunk is _END else chunk)
            self._finish(self, job)
            return
        try:
            if job.error is None:
                self._deliver(job, chunk, slot)
        except BaseException as exc:  # kept on the job; wait() raises it
            job.error = exc
        finally:
            self._give(slot)

    def _give(self, slot: Slot) -> None:
        self._gauge.give(slot.nbytes)
        self._free.put(slot)
