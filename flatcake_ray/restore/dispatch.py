"""The restore pipeline's scheduler bookkeeping, mixed into ``RestorePipeline`` (which
provides the attributes declared below): starting the restores the scheduler lets go on a
lane, and finishing each restore its lane is done with.

This is the half of the pipeline that lane threads run, so it keeps the promise of
``pipeline.py``'s module docstring: every restore submitted is finished exactly once, by its
lane or, if the scheduler's bookkeeping fails, with that error (``_break``); that is what
wakes its waiters and ``close()``, and no error here may end a lane thread. Submission and the
pipeline's lifecycle stay in ``pipeline.py``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable

from flatcake_ray.core.gva import Medium
from flatcake_ray.core.scheduler import Scheduler
from flatcake_ray.restore.source import Source
from flatcake_ray.restore.window import Job, Lane

__all__ = ["LaneDispatch"]

logger = logging.getLogger(__name__)


class LaneDispatch:
    scheduler: Scheduler
    source: Source
    _clock: Callable[[], float]
    _jobs: dict[Hashable, Job]  # submitted, not yet dispatched by the scheduler
    _idle: list[Lane]  # SSD windows running no restore
    _dram_lane: Lane
    _lock: threading.Lock
    _drained: threading.Condition
    _live: int  # submitted, not yet finished
    _fault: BaseException | None

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
    def _finish(self, lane: Lane, job: Job) -> None:
        """The lane is done with ``job``; never raises (a lane thread must survive it)."""
        outcome = job.outcome
        handle, now = job.handle, self._clock()
        outcome.queued_s = (handle.started_at or now) - handle.submitted_at
        outcome.seconds = now - outcome.asked_at
        try:
            outcome.pages = job.handle.pages if job.error is None else 0
            job.handle._shrink(self.source.release(job.leased, outcome))
            outcome.pages = job.handle.pages if job.error is None else 0
        except BaseException as exc:  # raised by wait()
            job.error = job.error or exc
        job.handle._finish(self._clock(), job.error, outcome)
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
            job.outcome.pages = 0
            job.handle._finish(now, exc, job.outcome)
            self._live -= 1
        self._drained.notify_all()
        for job in failed:
            try:
                self.source.release(job.leased, job.outcome)
            except BaseException:  # a lane thread runs this: it must live on; wait() raises exc
                logger.exception("releasing the lease of restore %d failed", job.handle.request_id)
