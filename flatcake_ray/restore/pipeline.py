"""Layer-pipelined restores into a paged KV pool through bounded staging windows.

FC-CIO's read path (paper 3.4) with FC-MAS admission (3.3), on the client side.

Who calls what, in which order:

1. ``pipeline = RestorePipeline(store, windows=2, slot_layers=2)``, once per engine worker. All
   staging memory is allocated here and never again: ``windows`` windows of ``slot_layers``
   slots of ``slot_bytes`` aligned host bytes (plus as much HBM when ``device`` is a GPU).
2. ``handle = pipeline.submit(keys, pool, slot_ids, layout)``, from any thread: leases the
   consecutive hits of ``keys`` (their scopes cannot be reclaimed until the restore ends) and
   queues the restore. Prefix page ``i`` goes to slot ``slot_ids[i]`` of every layer of
   ``pool`` (``layer_first`` ``[layers, slots, *page]`` or ``page_first`` ``[slots, layers,
   *page]``). Slots past the hits are left alone. ``pipeline.submit(keys, dest)`` takes any
   :class:`~flatcake_ray.restore_dest.Destination` instead, e.g. :class:`LayerTensors` for
   one KV tensor per layer (vLLM's), where page ``i`` goes to block ``block_ids[i]``.
3. ``handle.wait_for_layer(l)`` before layer ``l``'s attention (vLLM's ``wait_for_layer_load``)
   or ``handle.wait()``: block until that layer (every layer) is in place, and return the
   verified prefix length so far. A worker's exception is raised here as :class:`RestoreError`.
   The count is final after ``wait()``; a checksum failure in a later layer can still shrink
   it, and slots past it hold nothing usable.
4. ``pipeline.close(timeout=None)``: takes no new restores, lets every submitted one finish,
   stops workers. Close the pipeline before its store, and never from a worker callback.

Every restore submitted is finished exactly once, by its lane or, if the scheduler's
bookkeeping fails, by the pipeline with that error; that is what wakes its waiters and
``close()``. Lane threads survive any error of a restore or of the bookkeeping.

Admission. Each restore is classified by its slowest medium. One whose hits are all in DRAM is
dispatched at once and copied by the DRAM lane (from the shared arena; it holds no SSD window).
One that touches SSD queues for a window in highest-response-ratio order; a window runs one
restore at a time, so at most ``windows`` SSD restores stream at once. A queued restore only
waits: it is never revoked, and nothing falls back to recompute because windows are busy.
``policy="fcfs"`` is the paper's ablation: one line, nothing passes a head not yet restored.

Pipelining. A window has a reader thread and a scatter thread. The reader fills free slots
with the next chunk of the current layer (coalesced O_DIRECT reads; the GIL is released while
the drive works), so while the scatter thread checksums layer ``l`` and scatters it into its
pages' slots, the reads of ``l + 1`` are in flight. A layer larger than a slot streams through
the slots in bounded chunks, in order (see ``restore_plan.py``). With a GPU pool a chunk is
copied to the slot's HBM twin and scattered there by ``cuda_ext``'s kernel on the window's
stream; the layer counts as in place once that stream has finished it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from flatcake_ray.config import ALIGN
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.gva import encode as encode_gva
from flatcake_ray.core.keys import KeyLike, PageKey
from flatcake_ray.core.scheduler import Scheduler, SchedulerConfig
from flatcake_ray.cuda_ext.scatter import LAYER_FIRST, Layout, scatter_layer
from flatcake_ray.errors import (
    ConfigError,
    RestoreError,
    RestoreTimeoutError,
    ShapeError,
    StoreClosedError,
)
from flatcake_ray.media.buffers import AlignedBuffer
from flatcake_ray.node.reader import ReadOutcome
from flatcake_ray.node.store import FlatCakeStore
from flatcake_ray.restore.dest import (
    Destination,
    LayerTensors,
    PagedPool,
    ScatterFn,
    as_destination,
)
from flatcake_ray.restore.plan import LayerChunk, LayerStager, PageRun
from flatcake_ray.restore.window import Gauge, Job, Lane, RestoreHandle, Slot

__all__ = [
    "DEFAULT_SLOT_BYTES",
    "Destination",
    "LayerTensors",
    "PagedPool",
    "RestoreHandle",
    "RestorePipeline",
]

DEFAULT_SLOT_BYTES = 16 << 20
logger = logging.getLogger(__name__)


class RestorePipeline:
    """See the module docstring for the contract.

    ``windows``: SSD restores streaming at once (the scheduler's prefetch budget).
    ``slot_layers``: slots per window (2: double-buffered). ``slot_bytes``: one slot, a multiple
    of 4 KiB holding at least a page plus 4 KiB (default 16 MiB); a layer larger than a slot
    streams through in chunks. ``device``: where the pools live ("cpu" or a CUDA device).
    ``policy`` / ``starvation_limit``: FC-MAS (``"fc-mas"``) or the ``"fcfs"`` ablation.
    ``scatter``: the page scatter (``cuda_ext.scatter.scatter_layer``; tests wrap it).
    ``clock``: seconds, never going back, for the scheduler and the handles' timestamps.
    """

    def __init__(
        self,
        store: FlatCakeStore,
        *,
        windows: int = 2,
        slot_layers: int = 2,
        slot_bytes: int | None = None,
        device: str | torch.device = "cpu",
        policy: str = "fc-mas",
        starvation_limit: float | None = None,
        scatter: ScatterFn = scatter_layer,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (isinstance(windows, int) and windows >= 1):
            raise ConfigError("windows must be an integer >= 1")
        if not (isinstance(slot_layers, int) and slot_layers >= 1):
            raise ConfigError("slot_layers must be an integer >= 1")
        config = store.config
        floor = -(-(config.page_bytes + ALIGN) // ALIGN) * ALIGN
        self.slot_bytes = max(DEFAULT_SLOT_BYTES, floor) if slot_bytes is None else slot_bytes
        LayerStager.check_capacity(self.slot_bytes, config.page_bytes)
        self.store = store
        self.device = _resolve_device(device)
        self.scheduler = Scheduler(SchedulerConfig(windows, None, policy, starvation_limit))
        self._scatter, self._clock = scatter, clock
        self._gauge = Gauge()
        self._buffers: list[AlignedBuffer] = []
        self._windows = [
            self._lane(f"flatcake-window{i}", slot_layers, host=True) for i in range(windows)
        ]
        self._dram_lane = self._lane("flatcake-dram", slot_layers, host=False)
        self._idle = list(self._windows)
        self._jobs: dict[int, Job] = {}  # submitted, not yet dispatched by the scheduler
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._live = 0  # submitted, not yet finished
        self._ids = itertools.count()
        self._closed = False  # no new restores
        self._stopped = False  # workers stopped, staging memory freed
        self._fault: BaseException | None = None

    # ---- memory ------------------------------------------------------------------------
    @property
    def window_bytes(self) -> int:
        """All staging memory this pipeline holds (host and HBM); fixed at construction."""
        return sum(slot.nbytes for lane in (*self._windows, self._dram_lane) for slot in lane.slots)

    @property
    def held_bytes(self) -> int:
        return self._gauge.held

    @property
    def high_water_bytes(self) -> int:
        """The most staging bytes chunks in flight ever held at once."""
        return self._gauge.high_water

    def _lane(self, name: str, slot_layers: int, *, host: bool) -> Lane:
        gpu = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if gpu else None
        slots = []
        for _ in range(slot_layers):
            buffer = AlignedBuffer(self.slot_bytes) if host else None
            if buffer is not None:
                self._buffers.append(buffer)
            twin = (
                torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) if gpu else None
            )
            nbytes = (buffer.nbytes if buffer else 0) + (self.slot_bytes if gpu else 0)
            slots.append(Slot(buffer.array if buffer else None, twin, stream, nbytes))
        return Lane(name, slots, self._gauge, self._deliver, self._finish, overlap=host)

    # ---- submission --------------------------------------------------------------------
    def submit(
        self,
        keys: Sequence[KeyLike | PageKey],
        dest: Destination | torch.Tensor | np.ndarray,
        slot_ids: Sequence[int] | np.ndarray | torch.Tensor | None = None,
        layout: Layout = LAYER_FIRST,
        *,
        namespace: str | None = None,
    ) -> RestoreHandle:
        """Lease the hits of ``keys`` and queue their restore into ``dest`` (a
        :class:`Destination`, or a pool with its ``slot_ids`` and ``layout``); never blocks
        on I/O."""
        self._check_open()
        dest = self._check_dest(as_destination(dest, slot_ids, layout), len(keys))
        lease = self.store.lease(keys, namespace=namespace)
        handed_over = False  # once a job owns the lease, its finish releases it
        try:
            stager = LayerStager(self.store.reader, lease, self.slot_bytes)
            config = self.store.config
            gvas = [encode_gva(s.medium, config.node_id, s.offset) for s in lease.segments.values()]
            kv_bytes = stager.ssd_pages * config.layers * config.page_bytes
            medium = Medium.SSD if kv_bytes else Medium.DRAM
            with self._lock:
                self._check_open()
                now = self._clock()
                handle = RestoreHandle(next(self._ids), config.layers, lease.hits, medium, now)
                if lease.hits == 0:
                    handle._finish(now, None)
                    return handle
                self.scheduler.submit(handle.request_id, now, gvas, kv_bytes)
                self._jobs[handle.request_id] = Job(handle, lease, stager, dest)
                self._live += 1
                handed_over = True
                self._pump_or_break()
            return handle
        finally:
            if not handed_over:
                self.store.release(lease)

    def _check_open(self) -> None:
        if self._fault is not None:
            raise RestoreError("the restore pipeline broke") from self._fault
        if self._closed:
            raise StoreClosedError("the restore pipeline is closed")

    def _check_dest(self, dest: Destination, keys: int) -> Destination:
        if dest.device != self.device:
            raise ShapeError(f"the destination must be on {self.device}, not on {dest.device}")
        config = self.store.config
        if dest.layers != config.layers or dest.page_bytes != config.page_bytes:
            raise ShapeError(
                f"the destination has {dest.layers} layers of {dest.page_bytes}-byte pages; "
                f"the store has {config.layers} layers of {config.page_bytes}-byte pages"
            )
        if dest.pages != keys:
            raise ShapeError(f"the destination maps {dest.pages} pages, one per key: need {keys}")
        return dest

    # ---- scheduling (callers hold self._lock) --------------------------------------------
    def _pump_or_break(self) -> None:
        try:
            self._pump()
        except BaseException as exc:  # every queued handle is failed with it, wait() raises it
            self._break(exc)

    def _pump(self) -> None:
        now = self._clock()
        for request in self.scheduler.start_prefetches(now):
            job = self._jobs[request.request_id]
            job.handle._start(now)
            self._idle.pop().start(job)  # the scheduler's budget is the number of windows
            job.dispatched = True
        for request in self.scheduler.pop_ready(now, None):
            job = self._jobs.pop(request.request_id)
            if request.medium is Medium.DRAM:
                job.handle._start(now)
                self._dram_lane.start(job)
                job.dispatched = True
            # an SSD restore popped here is already in place: its window finished it

    # ---- the scatter threads' side -------------------------------------------------------
    def _deliver(self, job: Job, chunk: LayerChunk, slot: Slot) -> None:
        source = self.store.arena.view if chunk.medium is Medium.DRAM else slot.host
        for span in chunk.hashes:
            span.check.update(source[span.offset : span.offset + span.length])
            if span.last and not span.check.matches():
                job.bad_scopes.add(span.check.scope_id)
                job.handle._shrink(span.check.first_position)
        runs = [run for run in chunk.runs if run.scope_id not in job.bad_scopes]
        if slot.device is None:
            self._scatter_host(job, chunk, runs, source)
        else:
            self._scatter_device(job, chunk, runs, source, slot)
        if chunk.medium is Medium.DRAM:
            job.dram_bytes += sum(len(run.positions) for run in runs) * self.store.config.page_bytes
        if chunk.last:
            job.handle._layer_done(chunk.layer)

    def _scatter_host(self, job: Job, chunk: LayerChunk, runs: list[PageRun], source) -> None:
        page_bytes = self.store.config.page_bytes
        for run in runs:
            staged = source[run.offset : run.offset + len(run.positions) * page_bytes]
            job.dest.scatter(torch.from_numpy(staged), run.positions, chunk.layer, self._scatter)

    def _scatter_device(
        self, job: Job, chunk: LayerChunk, runs: list[PageRun], source, slot: Slot
    ) -> None:
        page_bytes = self.store.config.page_bytes
        staged: list[tuple[torch.Tensor, PageRun]] = []
        with torch.cuda.stream(slot.stream):
            if chunk.medium is Medium.SSD:  # one host-to-device copy of the whole chunk
                slot.device[: chunk.nbytes].copy_(torch.from_numpy(source[: chunk.nbytes]))
                for run in runs:
                    length = len(run.positions) * page_bytes
                    staged.append((slot.device[run.offset : run.offset + length], run))
            else:  # DRAM: pack the wanted runs from the pinned arena into the slot
                cursor = 0
                for run in runs:
                    length = len(run.positions) * page_bytes
                    twin = slot.device[cursor : cursor + length]
                    twin.copy_(
                        torch.from_numpy(source[run.offset : run.offset + length]),
                        non_blocking=True,
                    )
                    staged.append((twin, run))
                    cursor += length
            for twin, run in staged:
                job.dest.scatter(twin, run.positions, chunk.layer, self._scatter, slot.stream)
        slot.stream.synchronize()  # the slot is reused, and the layer counts, only after this

    def _finish(self, lane: Lane, job: Job) -> None:
        """The lane is done with ``job``; never raises (a lane thread must survive it)."""
        try:
            try:
                self._account(job)
            finally:
                self.store.release(job.lease)
        except BaseException as exc:  # raised by wait()
            job.error = job.error or exc
        job.handle._finish(self._clock(), job.error)
        with self._lock:
            # Counted out first: close() must not wait for a job whatever the bookkeeping does.
            self._live -= 1
            try:
                if lane is not self._dram_lane:
                    self._window_done(lane, job)
            except BaseException as exc:
                self._break(exc)
            finally:
                self._drained.notify_all()

    def _window_done(self, lane: Lane, job: Job) -> None:
        self._idle.append(lane)
        if self._fault is not None:
            return  # the scheduler is broken: nothing is queued or started any more
        request_id, now = job.handle.request_id, self._clock()
        if job.error is None:
            self.scheduler.prefetch_done(request_id, now)
        else:
            self.scheduler.cancel(request_id, now)
            self._jobs.pop(request_id)
        self._pump()

    def _break(self, exc: BaseException) -> None:
        """The scheduler bookkeeping failed (callers hold self._lock): fail every restore not
        yet dispatched with it. A dispatched one finishes on its own lane."""
        self._fault = self._fault or exc
        now = self._clock()
        failed = [job for job in self._jobs.values() if not job.dispatched]
        self._jobs = {i: j for i, j in self._jobs.items() if j.dispatched}
        for job in failed:  # woken and counted out before anything else can raise
            job.handle._finish(now, exc)
            self._live -= 1
        self._drained.notify_all()
        for job in failed:
            try:
                self.store.release(job.lease)
            except BaseException:  # a lane thread runs this: it must live on; wait() raises exc
                logger.exception("releasing the lease of restore %d failed", job.handle.request_id)

    def _account(self, job: Job) -> None:
        restored = job.handle.pages if job.error is None else 0
        outcome = ReadOutcome(
            pages_ok=restored,
            bad_scopes=set(job.bad_scopes),
            ssd_commands=job.ssd_commands,
            ssd_bytes=job.ssd_bytes,
            dram_bytes=job.dram_bytes,
        )
        self.store.account_read(outcome, delivered_pages=restored)

    # ---- lifecycle ---------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Refuse new restores, wait for every submitted one, stop the workers. A restore
        still running after ``timeout`` seconds raises :class:`RestoreTimeoutError` and
        leaves the workers running (close again to wait longer)."""
        with self._lock:
            self._closed = True
            if self._stopped:
                return
            if not self._drained.wait_for(lambda: self._live <= 0, timeout):
                raise RestoreTimeoutError(
                    f"{self._live} restores still running after {timeout} s; not closed"
                )
            if self._stopped:  # a concurrent close() stopped them while this one waited
                return
            self._stopped = True
        for lane in (*self._windows, self._dram_lane):
            lane.stop()
        for buffer in self._buffers:
            buffer.close()

    def __enter__(self) -> RestorePipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"the staging window lives on the CPU or a CUDA GPU, not {device}")
    return device
