"""The scatter side of a window: a filled (or mapped) chunk checked and put in place.

Runs on a lane's scatter thread (``Lane`` calls :meth:`ChunkDelivery.deliver`): the chunk's
checksum spans are fed and decided, the page runs of scopes that failed a check or a transfer
are dropped, and the rest are scattered into the destination, on the host (one memcpy per
run) or on the GPU (the slot's device twin, then the scatter kernel on the window's stream).
On the host, a group's layers are checked and scattered one after another, and each is
reported in place as soon as it is, so a group's first layer can be waited on before its
last has landed. A checked chunk (of the mapped arena, or a filled slot) bound for
consecutive host slots is copied there and checked there (the reader's own memory: one copy,
no private one), each whole block hashed right after its copy; one bound for pages split in
memory or apart (vLLM's K and V planes) is copied block by block into their pieces, hashed in
the same pass (``restore/copy_check.py``); other whole checksum blocks are hashed together
on the idle cores (``cuda_ext/host_hash.py``)."""

from __future__ import annotations

import bisect
import threading
from typing import Any

import numpy as np
import torch

from flatcake_ray.core.block_checks import HashSpan
from flatcake_ray.core.chunks import LayerChunk, PageRun
from flatcake_ray.cuda_ext.host_copy import copy_into
from flatcake_ray.cuda_ext.host_hash import xxh3_many
from flatcake_ray.cuda_ext.scatter import scatter_layer
from flatcake_ray.restore.copy_check import (
    ChunkChecks,
    copy_and_check,
    copy_blocks_checked,
    copy_into_pieces,
)
from flatcake_ray.restore.dest import ScatterFn
from flatcake_ray.restore.source import FillStats, Slot
from flatcake_ray.restore.window import Job


class ChunkDelivery:
    def __init__(self, scatter: ScatterFn, page_bytes: int) -> None:
        self._scatter = scatter
        # Checked pages go straight into consecutive host slots only when the scatter is the
        # package's own; one a caller wrapped (tests watch and hold layers) sees every page.
        self._direct = scatter is scatter_layer
        self.page_bytes = page_bytes
        self._scratch = _Scratch()  # per scatter thread: checked copies of mapped bytes

    def deliver(
        self, job: Job, chunk: LayerChunk, slot: Slot | None, stats: FillStats | None
    ) -> None:
        if id(chunk) in job.failed_chunks:
            pass  # its pages are misses already; the layers still count as done below
        elif slot is not None and slot.device is not None:
            source = self._source_bytes(job, chunk, slot, stats)
            self._check(job, chunk.all_spans(), _Whole(source))
            runs = self._kept(job, chunk.runs)
            self._count(job, chunk, runs, stats)
            self._scatter_device(job, chunk, runs, source, slot, stats)
        elif targets := self._in_place_targets(job, chunk):
            self._deliver_in_place(job, chunk, slot, stats, targets)
        elif self._copied_into_pieces(job, chunk, slot, stats):
            pass  # a checked chunk copied straight into host pieces, hashed as it went
        elif chunk.mapped and self._copied_checked(job, chunk):
            pass  # a checked chunk bound for pages split in memory: copied, checked, scattered
        else:
            self._deliver_host(job, chunk, slot, stats)
        if chunk.done_layer is not None:
            job.handle._layer_done(chunk.done_layer)

    def _deliver_host(
        self, job: Job, chunk: LayerChunk, slot: Slot | None, stats: FillStats | None
    ) -> None:
        """Check the chunk's bytes where they are (a slot, or a private copy of the mapped
        medium), then scatter them into host memory, layer by layer, so a group's first
        layers are waited on before its last lands."""
        source = self._source_bytes(job, chunk, slot, stats)
        spans = chunk.all_spans()
        layers = {run.layer for run in chunk.runs} | {s.layer for s in chunk.hashes}
        for layer in sorted(layers | {rows.layer for rows in chunk.blocks}):
            runs = self._kept(job, [run for run in chunk.runs if run.layer == layer])
            self._check(job, [s for s in spans if s.layer == layer], _Whole(source))
            runs = self._kept(job, runs)
            self._scatter_host(job, runs, source)
            self._count(job, chunk, runs, stats)
            if chunk.done_layer is not None:
                job.handle._layer_done(layer)

    def _deliver_in_place(
        self,
        job: Job,
        chunk: LayerChunk,
        slot: Slot | None,
        stats: FillStats | None,
        targets: dict[int, np.ndarray],
    ) -> None:
        """A checked chunk (of the mapped medium, or a filled host slot) bound for host
        pieces: every layer of it in one batch of copies and checks. A chunk holds several
        layers only when they are small, and they are then in place together."""
        checks = ChunkChecks.of(chunk)
        runs = self._kept(job, chunk.runs)
        self._deliver_then_check(job, self._bytes_of(job, chunk, slot), runs, checks, targets)
        runs = self._kept(job, runs)
        for layer in sorted({run.layer for run in chunk.runs}):
            self._count(job, chunk, [run for run in runs if run.layer == layer], stats)
            if chunk.done_layer is not None:
                job.handle._layer_done(layer)

    def _copied_into_pieces(
        self, job: Job, chunk: LayerChunk, slot: Slot | None, stats: FillStats | None
    ) -> bool:
        """A checked chunk of whole blocks only, each block copied straight into the host
        pieces its pages go to and hashed in that pass (``copy_into_pieces``); a scope found
        wrong has its pages zeroed. False, with nothing done, where that pass does not apply."""
        if not chunk.checked or chunk.hashes or not self._direct:
            return False
        runs = self._kept(job, chunk.runs)
        rows = ChunkChecks.of(chunk).rows
        wrong = copy_into_pieces(
            self._bytes_of(job, chunk, slot), rows, runs, job.dest, self.page_bytes
        )
        if wrong is None:
            return False
        for scope_id in set(rows.scope[wrong].tolist()):
            self._failed_scope(job, scope_id)
        for run in runs:
            if run.scope_id in job.outcome.bad_scopes:
                zeros = torch.zeros(len(run.positions) * self.page_bytes, dtype=torch.uint8)
                job.dest.scatter(zeros, run.positions, run.layer, self._scatter)
        runs = self._kept(job, runs)
        for layer in sorted({run.layer for run in chunk.runs}):
            self._count(job, chunk, [run for run in runs if run.layer == layer], stats)
            if chunk.done_layer is not None:
                job.handle._layer_done(layer)
        return True

    def _copied_checked(self, job: Job, chunk: LayerChunk) -> bool:
        """A checked mapped chunk of whole blocks only, into host pages that are not one
        piece each (vLLM's K and V planes): its blocks copied into this thread's scratch
        buffer, each hashed as it is copied (one pass; what is checked is the private copy,
        which is what is delivered), then scattered layer by layer. False, with nothing done,
        where the chunk has other checks or the native pass is not built."""
        if not chunk.checked or chunk.hashes or not self._direct:
            return False
        rows = ChunkChecks.of(chunk).rows
        lo, hi = int(rows.offset[0]), int((rows.offset + rows.length).max())
        scratch = self._scratch_of(hi - lo)
        wrong = copy_blocks_checked(job.mapped[chunk.medium].view, rows, scratch)
        if wrong is None:
            return False
        for scope_id in set(rows.scope[wrong].tolist()):
            self._failed_scope(job, scope_id)
        source = _Rebased(scratch, lo)
        for layer in sorted({run.layer for run in chunk.runs}):
            runs = self._kept(job, [run for run in chunk.runs if run.layer == layer])
            self._scatter_host(job, runs, source)
            self._count(job, chunk, runs, None)
            if chunk.done_layer is not None:
                job.handle._layer_done(layer)
        return True

    def _scratch_of(self, nbytes: int) -> np.ndarray:
        """This thread's scratch buffer, at least ``nbytes`` long (reused: its chunk is
        delivered before the next one is copied into it)."""
        if len(self._scratch.buffer) < nbytes:
            self._scratch.buffer = np.empty(nbytes, dtype=np.uint8)
        return self._scratch.buffer[:nbytes]

    def _in_place_targets(self, job: Job, chunk: LayerChunk) -> dict[int, np.ndarray]:
        """For a checked chunk whose every run lands in one contiguous piece of host memory:
        each run's piece (by ``id(run)``); else empty. Such a chunk is copied straight from
        the mapped medium (or its slot) into the destination and checked there, each block as
        it is copied: the reader's own memory, so what is checked is what it keeps, with no
        private copy first and no second pass over the bytes."""
        if not (chunk.checked and self._direct):
            return {}
        targets = {}
        for run in chunk.runs:
            piece = job.dest.host_pages(run.layer, run.positions)
            if piece is None:
                return {}
            targets[id(run)] = piece
        return targets

    def _bytes_of(self, job: Job, chunk: LayerChunk, slot: Slot | None) -> np.ndarray:
        """Where a chunk's bytes are on the host: the mapped medium, or its filled slot."""
        if chunk.mapped:
            return job.mapped[chunk.medium].view
        assert slot is not None and slot.host is not None
        return slot.host

    def _deliver_then_check(
        self,
        job: Job,
        medium: np.ndarray,
        runs: list[PageRun],
        checks: ChunkChecks,
        targets: dict[int, np.ndarray],
    ) -> None:
        """Copy ``runs`` from ``medium`` (the mapped medium, or a filled slot) to their
        pieces, then check ``checks``: the delivered bytes from the destination, the bytes
        between runs (a block's pages this restore does not take) from the medium. The pieces
        of a scope that fails are zeroed: a wrong byte never stays in this chunk's pieces."""
        checked = copy_and_check(medium, runs, targets, checks, self.page_bytes)
        if checked is None:  # no native pass: copy every run, then hash
            for run in runs:
                length = len(run.positions) * self.page_bytes
                copy_into(targets[id(run)], medium[run.offset : run.offset + length])
            spans = checks.spans_at(np.arange(len(checks.rows)))
        else:
            for scope_id in set(checks.rows.scope[checked.failed].tolist()):
                self._failed_scope(job, scope_id)
            spans = checks.spans_at(checked.left)
        self._check(job, spans, _Delivered(medium, runs, targets, self.page_bytes))
        for run in runs:
            if run.scope_id in job.outcome.bad_scopes:
                targets[id(run)].fill(0)

    def _checked_copy(self, view: np.ndarray, chunk: LayerChunk) -> Any:
        """A mapped chunk's bytes to check and deliver. Checked ones are copied out first:
        the mapped memory is shared (a put's writer maps it writable), so bytes checked in
        place could change before they are scattered; a private copy is what is checked and
        what is delivered. The copy goes into this thread's scratch buffer, reused (its
        chunk is delivered before the next one is). Unchecked ones are read in place."""
        if not chunk.checked:
            return view
        ends = [(span.offset, span.offset + span.length) for span in chunk.all_spans()]
        ends += [(r.offset, r.offset + len(r.positions) * self.page_bytes) for r in chunk.runs]
        lo, hi = min(a for a, _ in ends), max(b for _, b in ends)
        scratch = self._scratch_of(hi - lo)
        np.copyto(scratch, view[lo:hi])
        return _Rebased(scratch, lo)

    def _kept(self, job: Job, runs: list[PageRun]) -> list[PageRun]:
        """The runs whose scopes have not failed a checksum or a transfer."""
        dropped = job.outcome.bad_scopes | job.outcome.lost_scopes
        kept = [run for run in runs if run.scope_id not in dropped]
        return kept

    def _source_bytes(
        self, job: Job, chunk: LayerChunk, slot: Slot | None, stats: FillStats | None
    ) -> Any:
        """Where a chunk's bytes are: the mapped medium (a private copy when checked), or its
        slot's host bytes."""
        if chunk.mapped:
            return self._checked_copy(job.mapped[chunk.medium].view, chunk)
        assert slot is not None and slot.host is not None
        if stats is not None and stats.on_device:  # GDS: checksums are taken on the host
            with torch.cuda.stream(slot.stream):
                torch.from_numpy(slot.host).copy_(slot.device, non_blocking=True)
            slot.stream.synchronize()
        return slot.host

    def _check(self, job: Job, spans: list[HashSpan], source: _Whole | _Delivered) -> None:
        """Feed and decide ``spans``; a whole block in one piece (most) is hashed with the
        others on the idle cores (``xxh3_many``), the rest fed in order."""
        wholes: list[tuple[HashSpan, np.ndarray]] = []
        for span in spans:
            *before, last = source.pieces(span.offset, span.offset + span.length)
            if not before and span.last and not span.check.started:
                wholes.append((span, last))
                continue
            for piece in before:
                span.check.update(piece)
            if not span.check.feed(last, span.last):
                self._failed(job, span)
        found = xxh3_many([piece for _, piece in wholes]) if len(wholes) > 1 else None
        for index, (span, piece) in enumerate(wholes):
            if found is None:
                good = span.check.feed(piece, True)
            else:
                good = int(found[index]) == span.check.expected
            if not good:
                self._failed(job, span)

    def _failed(self, job: Job, span: HashSpan) -> None:
        self._failed_scope(job, span.check.scope_id)

    def _failed_scope(self, job: Job, scope_id: int) -> None:
        job.outcome.bad_scopes.add(scope_id)
        job.handle._shrink(job.plan.scope_first[scope_id])

    def _scatter_host(self, job: Job, runs: list[PageRun], source) -> None:
        page_bytes = self.page_bytes
        for run in runs:
            staged = source[run.offset : run.offset + len(run.positions) * page_bytes]
            job.dest.scatter(torch.from_numpy(staged), run.positions, run.layer, self._scatter)

    def _scatter_device(
        self,
        job: Job,
        chunk: LayerChunk,
        runs: list[PageRun],
        source,
        slot: Slot,
        stats: FillStats | None,
    ) -> None:
        page_bytes = self.page_bytes
        staged: list[tuple[torch.Tensor, PageRun]] = []
        with torch.cuda.stream(slot.stream):
            if not chunk.mapped:  # one host-to-device copy of the whole chunk (none for GDS)
                if stats is None or not stats.on_device:
                    slot.device[: chunk.nbytes].copy_(torch.from_numpy(source[: chunk.nbytes]))
                for run in runs:
                    length = len(run.positions) * page_bytes
                    staged.append((slot.device[run.offset : run.offset + length], run))
            else:  # a mapped arena: pack the wanted runs from the pinned arena into the slot
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
                job.dest.scatter(twin, run.positions, run.layer, self._scatter, slot.stream)
        slot.stream.synchronize()  # the slot is reused, and the layer counts, only after this

    def _count(
        self, job: Job, chunk: LayerChunk, runs: list[PageRun], stats: FillStats | None
    ) -> None:
        """Pages delivered, per medium and per path (a mapped path's bytes too: no fill)."""
        pages = sum(len(run.positions) for run in runs)
        nbytes = pages * self.page_bytes
        wanted = job.outcome.bytes_wanted
        wanted[chunk.medium] = wanted.get(chunk.medium, 0) + nbytes
        path = job.mapped[chunk.medium].path if chunk.mapped else stats.path if stats else ""
        tally = job.outcome.tally(path)
        tally.pages += pages
        if chunk.mapped:
            tally.reads += len(runs)
            tally.bytes += nbytes


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.buffer = np.empty(0, dtype=np.uint8)


class _Whole:
    """A chunk's bytes in one piece (its slot, or a private copy of the mapped medium)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def pieces(self, lo: int, hi: int) -> list[np.ndarray]:
        return [self.data[lo:hi]]


class _Delivered:
    """A layer's bytes ``[lo, hi)`` of the mapped medium as checked after delivery: those of
    delivered ``runs`` from their destination pieces, the rest from the medium."""

    def __init__(
        self,
        medium: np.ndarray,
        runs: list[PageRun],
        targets: dict[int, np.ndarray],
        page_bytes: int,
    ) -> None:
        ordered = sorted(runs, key=lambda run: run.offset)
        self.medium = medium
        self.starts = [run.offset for run in ordered]
        self.ends = [run.offset + len(run.positions) * page_bytes for run in ordered]
        self.targets = [targets[id(run)] for run in ordered]

    def pieces(self, lo: int, hi: int) -> list[np.ndarray]:
        found = []
        index = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        at = lo
        while at < hi:
            while index < len(self.starts) and self.ends[index] <= at:
                index += 1
            if index == len(self.starts) or self.starts[index] >= hi:
                found.append(self.medium[at:hi])
                break
            start = self.starts[index]
            if at < start:
                found.append(self.medium[at:start])
                at = start
            stop = min(hi, self.ends[index])
            found.append(self.targets[index][at - start : stop - start])
            at = stop
        return found


class _Rebased:
    """Bytes ``[base, base + len(data))`` of a medium, sliced by medium offsets."""

    def __init__(self, data: np.ndarray, base: int) -> None:
        self.data = data
        self.base = base

    def __getitem__(self, span: slice) -> np.ndarray:
        return self.data[span.start - self.base : span.stop - self.base]
