"""The staging windows of the restore pipeline.

A :class:`Lane` is one bounded window: ``slot_layers`` slots, a reader thread that fills free
slots with a restore's chunks in order (``Source.fill``; O_DIRECT or a network read, the GIL
released while it waits) and a scatter thread that empties them in order through the
pipeline's ``deliver`` callback, so the reads of layer ``l + 1`` are in flight while layer ``l``
is scattered. A lane runs one restore (:class:`Job`) at a time; the reader blocks while every
slot is taken, which is the whole memory bound. A chunk whose fill raised ``TransferError``
is handed on marked failed (its pages become misses); any other exception ends up on the job
and is raised by ``RestoreHandle.wait``. ``pipeline.py`` owns the lanes and the contract.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from flatcake_ray.core.chunks import LayerChunk
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.plan import RestorePlan
from flatcake_ray.errors import TransferError
from flatcake_ray.restore.dest import Destination
from flatcake_ray.restore.handle import RestoreHandle
from flatcake_ray.restore.source import FillStats, Leased, MappedView, ReadOutcome, Slot, Source
from flatcake_ray.restore.unseal import SealedBlocks

__all__ = ["Gauge", "Job", "Lane"]

_END = object()  # reader -> scatter: the job has no more chunks


@dataclass
class Job:
    handle: RestoreHandle
    leased: Leased
    plan: RestorePlan
    dest: Destination
    source: Source
    mapped: dict[Medium, MappedView]  # the media read in place, and their paths
    outcome: ReadOutcome
    dispatched: bool = False  # handed to a lane, which finishes it; under the pipeline's lock
    error: BaseException | None = None
    failed_chunks: set[int] = field(default_factory=set)  # id() of chunks whose fill failed
    sealed: SealedBlocks | None = field(init=False)  # wanted blocks whose SSD bytes are sealed

    def __post_init__(self) -> None:
        self.sealed = SealedBlocks.of(self.leased.parts)

    def unseal(self, chunk: LayerChunk, slot: Slot, stats: FillStats | None) -> None:
        """A filled chunk's sealed blocks made plain in its slot (scatter thread), before
        they are delivered. A source without the key cannot read them: a plain miss, not a
        checksum failure (which would quarantine the tenant's pages for everyone)."""
        sealed = self.sealed
        if sealed is None or stats is None or id(chunk) in self.failed_chunks:
            return
        if chunk.medium is not Medium.SSD or sealed.scopes.isdisjoint(chunk.scopes):
            return
        key = self.source.seal_key
        if key is None or stats.on_device or slot.host is None:
            self.lose(chunk, TransferError("sealed SSD pages, and this reader has no key"))
            return
        sealed.unseal(key, chunk.reads, slot.host)

    def fill(self, chunk: LayerChunk, slot: Slot) -> FillStats:
        """Read a filled chunk into ``slot`` (reader thread) and count it."""
        stats = self.source.fill(self.leased, chunk.medium, chunk.reads, slot)
        tally = self.outcome.tally(stats.path)
        tally.reads += 1
        tally.bytes += stats.bytes
        tally.io_commands += stats.commands
        tally.seconds += stats.seconds
        medium = chunk.medium
        self.outcome.bytes_read[medium] = self.outcome.bytes_read.get(medium, 0) + stats.bytes
        self.outcome.commands[medium] = self.outcome.commands.get(medium, 0) + stats.commands
        self.outcome.actor_calls += stats.actor_calls
        return stats

    def lose(self, chunk: LayerChunk, exc: TransferError) -> None:
        """A chunk's bytes could not be had: its scopes' pages are misses from here on."""
        self.failed_chunks.add(id(chunk))
        self.outcome.failures.append(f"{chunk.medium.name} layers from {chunk.first_layer}: {exc}")
        self.outcome.lost_scopes.update(chunk.scopes)
        for scope_id in chunk.scopes:
            self.handle._shrink(self.plan.scope_first[scope_id])


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


Deliver = Callable[[Job, LayerChunk, Slot | None, FillStats | None], None]


class Lane:
    """One staging window: a reader thread fills its slots in order, a scatter thread empties
    them in order; one job at a time. ``deliver`` and ``finish(lane, job)`` run on the scatter
    thread. With ``overlap=False`` (a DRAM lane reading a mapped arena: there is nothing to
    wait for), and for a job whose every chunk is read in place into host memory, one thread
    does both, so a chunk costs no thread handoff. (Such a job may run while the scatter
    thread still delivers the job before it: different jobs, and the delivery keeps its
    scratch per thread.)"""

    def __init__(
        self,
        name: str,
        slots: list[Slot],
        gauge: Gauge,
        deliver: Deliver,
        finish: Callable[[Lane, Job], None],
        *,
        overlap: bool = True,
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
            # A job read in place only (a mapped medium into host memory) in one batch has no
            # read to overlap with: it is copied on this thread, the handoff's wake-up saved
            # (a small restore paid more for those than for its copies). One of several
            # batches is handed off: planning the next overlaps the copy (a 224 MB restore
            # copied here ran 8-11% slower, BENCHMARKS.md).
            inline = not self._overlap or (
                not job.plan.fills and job.dest.device.type == "cpu" and len(job.plan.groups) == 1
            )
            try:
                self._stage(job, inline)
                end: Any = _END
            except BaseException as exc:  # handed to the scatter side, raised by wait()
                end = exc
            # Exactly one end per job, outside the try: finishing twice would count it out twice.
            self._emit(job, end, None, None, inline)
        self._handoff.put(None)

    def _stage(self, job: Job, inline: bool) -> None:
        for chunk in self._planned(job):
            if job.error is not None:
                return  # the scatter side failed: stop reading, finish with its error
            if chunk.mapped and job.dest.device.type == "cpu":
                self._emit(job, chunk, None, None, inline)  # read in place: no slot needed
                continue
            slot = self._free.get()  # blocks while every slot is in use: the bound
            self._gauge.take(slot.nbytes)
            try:
                stats = self._fill(job, chunk, slot)
            except BaseException:
                self._give(slot)
                raise
            self._emit(job, chunk, slot, stats, inline)

    @staticmethod
    def _planned(job: Job) -> Iterator[LayerChunk]:
        """The job's chunks in order. A restore of mapped media only is planned as it goes
        (its first chunk is copied while the next are planned); one that fills slots is
        planned whole first, since the source is told every read before the first."""
        planned = (chunk for first, end in job.plan.groups for chunk in job.plan.chunks(first, end))
        if not job.plan.fills:
            return planned
        chunks = list(planned)
        filled = [(chunk.medium, chunk.reads) for chunk in chunks if not chunk.mapped]
        if filled:
            job.source.announce(job.leased, filled)
        return iter(chunks)

    @staticmethod
    def _fill(job: Job, chunk: LayerChunk, slot: Slot) -> FillStats | None:
        if chunk.mapped:
            return None
        started = time.perf_counter()
        try:
            return job.fill(chunk, slot)
        except TransferError as exc:
            job.lose(chunk, exc)
            return FillStats("failed", 0, 0, time.perf_counter() - started)

    def _emit(
        self, job: Job, chunk: Any, slot: Slot | None, stats: FillStats | None, inline: bool
    ) -> None:
        if inline:
            self._consume(job, chunk, slot, stats)
        else:
            self._handoff.put((job, chunk, slot, stats))

    def _scatter_loop(self) -> None:
        while (item := self._handoff.get()) is not None:
            self._consume(*item)

    def _consume(self, job: Job, chunk: Any, slot: Slot | None, stats: FillStats | None) -> None:
        if chunk is _END:
            self._finish(self, job)
            return
        if isinstance(chunk, BaseException):  # the reader side failed
            job.error = job.error or chunk
            self._finish(self, job)
            return
        try:
            if job.error is None:
                if slot is not None:
                    job.unseal(chunk, slot, stats)
                self._deliver(job, chunk, slot, stats)
        except BaseException as exc:  # kept on the job; wait() raises it
            job.error = exc
        finally:
            if slot is not None:
                self._give(slot)

    def _give(self, slot: Slot) -> None:
        self._gauge.give(slot.nbytes)
        self._free.put(slot)
