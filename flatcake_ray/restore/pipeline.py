"""The one restore engine: layer-pipelined restores through bounded staging windows.

FC-CIO's read path (paper 3.4) with FC-MAS admission (3.3), for every store: it reads through
a :class:`~flatcake_ray.restore.source.Source` (the node's own media, or the Ray client's
GVA-routed transports), so the in-process store and the Ray client restore with the same
code. A whole-prefix restore is a restore nobody waits on layer by layer.

Who calls what, in which order:

1. ``pipeline = RestorePipeline(source, windows=2, slot_layers=2)``, once per store and
   device. All staging memory is allocated here and never again: ``windows`` windows of
   ``slot_layers`` slots of ``slot_bytes`` aligned host bytes (plus as much HBM when ``device``
   is a GPU), and a DRAM lane (slots only where DRAM pages come through staging).
2. ``handle = pipeline.submit(keys, dest)`` from any thread: leases the consecutive hits of
   ``keys`` (their scopes cannot be reclaimed until the restore ends) and queues the restore.
   ``dest`` is a :class:`~flatcake_ray.restore.dest.Destination` (``LayerTensors``: one KV
   tensor per layer, vLLM's), or a pool with ``slot_ids`` and ``layout`` (``layer_first``
   ``[layers, slots, *page]`` or ``page_first`` ``[slots, layers, *page]``): prefix page ``i``
   goes to slot ``slot_ids[i]`` of every layer. Slots past the hits are left alone.
3. ``handle.wait_for_layer(l)`` before layer ``l``'s attention (vLLM's ``wait_for_layer_load``)
   or ``handle.wait()``: block until that layer (every layer) is in place, and return the
   verified prefix length so far. A worker's exception is raised here as :class:`RestoreError`.
   The count is final after ``wait()``; a checksum failure in a later layer, a transfer that
   failed or a lease the source withdrew can still shrink it, and slots past it hold nothing
   usable. ``handle.outcome`` then says what moved on which path.
4. ``pipeline.close(timeout=None)``: takes no new restores, lets every submitted one finish,
   stops workers. Close the pipeline before its source's store, never from a worker callback.

Every restore submitted is finished exactly once, by its lane or, if the scheduler's
bookkeeping fails, by the pipeline with that error; that is what wakes its waiters and
``close()``. Lane threads survive any error of a restore or of the bookkeeping (the
bookkeeping the lanes run is ``restore/dispatch.py``).

Admission. A restore is classified by its slowest medium. One whose hits are all in DRAM is
dispatched at once to the DRAM lane (it holds no SSD window). One that touches SSD queues for
a window in highest-response-ratio order; a window runs one restore at a time, so at most
``windows`` SSD restores stream at once. A queued restore only waits: it is never revoked.
``policy="fcfs"`` is the paper's ablation: one line, nothing passes a head not yet restored.

Pipelining. A window's reader thread fills free slots with the next chunk of the current layer
(``core/plan.py``) while its scatter thread checks and scatters the previous one. With a GPU
destination a chunk is copied to the slot's HBM twin and scattered there by ``cuda_ext``'s
kernel on the window's stream; the layer counts as in place once that stream has finished it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch

from flatcake_ray.core.gva import Medium
from flatcake_ray.core.gva import encode as encode_gva
from flatcake_ray.core.keys import KeyLike, PageKey
from flatcake_ray.core.parts import wanted_bytes
from flatcake_ray.core.plan import RestorePlan
from flatcake_ray.core.runs import align_up
from flatcake_ray.core.scheduler import Scheduler, SchedulerConfig
from flatcake_ray.cuda_ext.scatter import LAYER_FIRST, Layout, scatter_layer
from flatcake_ray.errors import (
    ConfigError,
    RestoreError,
    RestoreTimeoutError,
    ShapeError,
    StoreClosedError,
)
from flatcake_ray.media import cuda_host
from flatcake_ray.media.buffers import AlignedBuffer
from flatcake_ray.restore.deliver import ChunkDelivery
from flatcake_ray.restore.dest import Destination, ScatterFn, as_destination
from flatcake_ray.restore.dispatch import LaneDispatch
from flatcake_ray.restore.handle import RestoreHandle
from flatcake_ray.restore.source import Leased, ReadOutcome, Slot, Source
from flatcake_ray.restore.window import Gauge, Job, Lane

__all__ = ["DEFAULT_SLOT_BYTES", "RestoreHandle", "RestorePipeline"]

DEFAULT_SLOT_BYTES = 16 << 20
# A mapped chunk copied straight into host memory needs no slot: it is cut at this many
# slots' bytes instead, so a 224 MB restore is 4 batches of copies, not 16 (each costs
# ~0.2 ms of planning and handoff between copies). A checked chunk that cannot land in place
# is copied out to a scratch buffer of its size first (``restore/deliver.py``), so that is
# the bound where a destination's pages are not back to back. Where they are (every chunk
# lands in place, no scratch), up to 16 slots' bytes are one batch: a 224 MB restore is one
# copy on every idle thread (Ray local DRAM restore 10.85 -> 13.52 GB/s, BENCHMARKS.md).
IN_PLACE_SLOTS = 4
IN_PLACE_SLOTS_BACK_TO_BACK = 16


class RestorePipeline(LaneDispatch):
    """See the module docstring for the contract.

    ``windows``: SSD restores streaming at once (the scheduler's prefetch budget).
    ``slot_layers``: slots per window (2: double-buffered). ``slot_bytes``: one slot, a multiple
    of 4 KiB holding at least a page plus 4 KiB (default 16 MiB); a layer larger than a slot
    streams through in chunks. ``device``: where the destinations live ("cpu" or a CUDA device).
    ``policy`` / ``starvation_limit``: FC-MAS (``"fc-mas"``) or the ``"fcfs"`` ablation.
    ``scatter``: the page scatter (``cuda_ext.scatter.scatter_layer``; tests wrap it).
    ``clock``: seconds, never going back, for the scheduler and the handles' timestamps.
    """

    def __init__(
        self,
        source: Source,
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
        floor = align_up(source.page_bytes + 4096)
        self.slot_bytes = max(DEFAULT_SLOT_BYTES, floor) if slot_bytes is None else slot_bytes
        if (
            not isinstance(self.slot_bytes, int)
            or self.slot_bytes % 4096
            or self.slot_bytes < floor
        ):
            raise ConfigError(
                f"a staging slot of {self.slot_bytes!r} bytes must be a multiple of 4096 and "
                f"hold a page plus 4096 bytes ({floor})"
            )
        self.source = source
        self.device = _resolve_device(device)
        self.scheduler = Scheduler(SchedulerConfig(windows, None, policy, starvation_limit))
        self._clock = clock
        self._gauge = Gauge()
        self._delivery = ChunkDelivery(scatter, source.page_bytes)
        self._buffers: list[AlignedBuffer] = []
        self._pinned: list[np.ndarray] = []  # host slots registered with CUDA
        self._windows = [
            self._lane(f"flatcake-window{i}", slot_layers, True) for i in range(windows)
        ]
        self._dram_lane = self._lane("flatcake-dram", slot_layers, source.fills_dram)
        self._idle = list(self._windows)
        self._jobs: dict[Hashable, Job] = {}  # submitted, not yet dispatched by the scheduler
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
    def pinned_bytes(self) -> int:
        """Host staging bytes page-locked for CUDA now (a GPU pipeline's slots until it
        closes; 0 on the CPU)."""
        return sum(view.nbytes for view in self._pinned)

    @property
    def held_bytes(self) -> int:
        return self._gauge.held

    @property
    def high_water_bytes(self) -> int:
        """The most staging bytes chunks in flight ever held at once."""
        return self._gauge.high_water

    def _lane(self, name: str, slot_layers: int, host: bool) -> Lane:
        gpu = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if gpu else None
        slots = []
        for _ in range(slot_layers if host or gpu else 0):
            buffer = AlignedBuffer(self.slot_bytes) if host else None
            if buffer is not None:
                self._buffers.append(buffer)
                # Each chunk crosses to the GPU from here: page-locked, a copy is DMA.
                if gpu and cuda_host.register(buffer.array, "a restore staging slot"):
                    self._pinned.append(buffer.array)
            twin = (
                torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) if gpu else None
            )
            nbytes = (buffer.nbytes if buffer else 0) + (self.slot_bytes if gpu else 0)
            slots.append(Slot(buffer.array if buffer else None, twin, stream, nbytes))
        return Lane(name, slots, self._gauge, self._delivery.deliver, self._finish, overlap=host)

    # ---- submission --------------------------------------------------------------------
    def submit(
        self,
        keys: Sequence[KeyLike | PageKey],
        dest: Destination | torch.Tensor | np.ndarray,
        slot_ids: Sequence[int] | np.ndarray | torch.Tensor | None = None,
        layout: Layout = LAYER_FIRST,
        *,
        namespace: str | None = None,
        grant: Any = None,
    ) -> RestoreHandle:
        """Lease the hits of ``keys`` and queue their restore into ``dest``; blocks only on the
        lease (a local index probe, or one call to the node holding the prefix; none when
        ``grant``, the lease another process took for these keys, can be read under)."""
        self._check_open()
        dest = self._check_dest(as_destination(dest, slot_ids, layout), len(keys))
        asked_at = self._clock()
        source = self.source
        leased = (
            source.lease(keys, namespace)
            if grant is None
            else source.granted(grant, keys, namespace)
        )
        return self.submit_leased(leased, dest, asked_at=asked_at)

    def submit_leased(
        self, leased: Leased, dest: Destination, *, asked_at: float | None = None
    ) -> RestoreHandle:
        """Queue the restore of a prefix already leased from this pipeline's source; the
        restore now owns the lease (it is released when the restore ends). ``asked_at`` (when
        the lease was asked for) is for the source's accounting of the restore's latency."""
        handed_over = False
        try:
            self._check_open()
            job = self._job(leased, dest)
            job.outcome.asked_at = job.handle.submitted_at if asked_at is None else asked_at
            with self._lock:
                self._check_open()
                if leased.hits == 0:
                    self._finish_empty(job)
                    handed_over = True
                    return job.handle
                request_id = job.handle.request_id
                gvas = [encode_gva(p.medium, 0, p.offset) for p in leased.parts]
                kv_bytes = wanted_bytes(leased.parts, Medium.SSD)
                # The scheduler's clock never goes back: read it under the lock (a restore
                # made on another thread a moment earlier may be queued a moment later).
                self.scheduler.submit(request_id, self._clock(), gvas, kv_bytes)
                self._jobs[request_id] = job
                self._live += 1
                handed_over = True
                self._pump_or_break()
            return job.handle
        finally:
            if not handed_over:
                self.source.release(leased, ReadOutcome(0))

    def _job(self, leased: Leased, dest: Destination) -> Job:
        media = {part.medium for part in leased.parts}
        access = {medium: self.source.access(leased, medium) for medium in media}
        mapped = {m: self.source.view(leased, m) for m in media if access[m].mapped}
        in_place = self._in_place_bytes(dest, leased.hits)
        plan = RestorePlan(leased.parts, self.slot_bytes, access, in_place_bytes=in_place)
        medium = Medium.SSD if Medium.SSD in media else Medium.DRAM
        handle = RestoreHandle(next(self._ids), self.source.layers, leased, medium, self._clock())
        outcome = ReadOutcome(leased.hits, requested=dest.pages)
        return Job(handle, leased, plan, dest, self.source, mapped, outcome)

    def _in_place_bytes(self, dest: Destination, hits: int) -> int | None:
        """A batch's bytes for mapped chunks copied into host memory (None: a device). The
        destination is looked at only for a restore larger than one small batch (an
        engine's restores are not)."""
        if self.device.type != "cpu":
            return None
        small = IN_PLACE_SLOTS * self.slot_bytes
        if hits * dest.layers * dest.page_bytes <= small or not _back_to_back(dest, hits):
            return small
        return IN_PLACE_SLOTS_BACK_TO_BACK * self.slot_bytes

    def _finish_empty(self, job: Job) -> None:
        job.outcome.pages = 0
        job.outcome.seconds = self._clock() - job.outcome.asked_at
        self.source.release(job.leased, job.outcome)
        job.handle._finish(self._clock(), None, job.outcome)

    def _check_open(self) -> None:
        if self._fault is not None:
            raise RestoreError("the restore pipeline broke") from self._fault
        if self._closed:
            raise StoreClosedError("the restore pipeline is closed")

    def _check_dest(self, dest: Destination, keys: int) -> Destination:
        if dest.device != self.device:
            raise ShapeError(f"the destination must be on {self.device}, not on {dest.device}")
        source = self.source
        if dest.layers != source.layers or dest.page_bytes != source.page_bytes:
            raise ShapeError(
                f"the destination has {dest.layers} layers of {dest.page_bytes}-byte pages; "
                f"the store has {source.layers} layers of {source.page_bytes}-byte pages"
            )
        if dest.pages != keys:
            raise ShapeError(f"the destination maps {dest.pages} pages, one per key: need {keys}")
        return dest

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
        for view in self._pinned:
            cuda_host.unregister(view)
        self._pinned = []
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


def _back_to_back(dest: Destination, pages: int) -> bool:
    """Whether the first ``pages`` positions of every layer lie back to back in host memory
    (so every chunk of a restore into them lands in place)."""
    positions = np.arange(pages)
    return pages > 0 and all(
        dest.host_pages(layer, positions) is not None for layer in range(dest.layers)
    )
