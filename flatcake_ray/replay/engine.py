"""The discrete-event loop: one prefill engine, its HBM prefix cache, storage, devices.

A request's life on the virtual clock:

1. *arrive*: its leading pages in HBM are pinned; storage locates what follows (a lease for
   FlatCake); it is submitted to the live FC-MAS scheduler with its GVAs and SSD bytes.
2. *restore*: when the scheduler starts its prefetch, the SSD part is read on the modelled
   workers (tiered systems first take host staging for it, or are revoked or queued).
   FlatCake's scheduler first holds a prefetch of pages an older unfinished request will
   bring into HBM (``core/prefix_holds.py``); when that one's prefill ends the held request
   looks HBM and storage up again and reads only what is still on SSD.
3. *prefill*: when the GPU is free and the scheduler hands it over, HBM is looked at again
   (a sibling's prefill may have brought the prefix meanwhile); DRAM pages (and host-staged
   SSD pages) cross the H2D link layer by layer, overlapped with compute; compute is the
   profile's prefill time of the uncached tokens.
4. *done*: all its pages enter HBM; storage stores the new ones; the TTFT is recorded.
   FlatCake saves layer-wise, as the live store's ``begin_put``/``write_layer`` let an
   engine do: the put is planned when the prefill starts, its writes run alongside it, and
   its keys are published when both the writes and the prefill are done. Tiered systems
   write through to DRAM, which the model makes visible when the prefill ends.

Attribution of a request's reusable pages (those an infinite cache would hold), each to
exactly one of: HBM, DRAM, SSD, miss. Pages in HBM past the reusable prefix (brought by a
later-arriving request that ran first) count as ``late`` hits: they save compute but are not
part of the hit rate, whose denominator they are not in.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from flatcake_ray.config import PlacementConfig, StoreConfig
from flatcake_ray.core.scheduler import Scheduler, SchedulerConfig
from flatcake_ray.replay.devices import Link, SsdWorkers, StagingPool
from flatcake_ray.replay.flat_store import FlatStorage
from flatcake_ray.replay.flight import Flight
from flatcake_ray.replay.metrics import RequestRecords
from flatcake_ray.replay.pages import TracePages
from flatcake_ray.replay.profiles import Profile
from flatcake_ray.replay.systems import Storage, SystemSpec, Transfer
from flatcake_ray.replay.tiered_store import TieredStorage
from flatcake_ray.replay.tiers import KeyMap, PageLru

# Event kinds, in the order they run at equal times: data lands before it is asked for.
TRANSFER_DONE, PREFETCH_DONE, STAGING_FREE, PREFILL_DONE, ARRIVE = range(5)
UNBOUNDED = 1 << 30


class Replay:
    def __init__(
        self,
        pages: TracePages,
        arrivals: np.ndarray,
        profile: Profile,
        spec: SystemSpec,
        placement: PlacementConfig | None = None,
        store_config: StoreConfig | None = None,
    ) -> None:
        """``store_config``: a live node's store config for flat storage's catalog (its
        placement wins over ``placement``): the live replay predicts a running node."""
        self.pages, self.arrivals, self.profile, self.spec = pages, arrivals, profile, spec
        placement = store_config.placement if store_config else placement
        placement = placement or PlacementConfig(page_tokens=profile.page_tokens)
        if spec.dram_policy is not None:
            placement = dataclasses.replace(placement, dram_policy=spec.dram_policy)
        if store_config is not None:
            store_config = dataclasses.replace(store_config, placement=placement)
        self.storage: Storage = (
            FlatStorage(profile, spec, pages, placement, arrivals, store_config)
            if spec.storage == "flat"
            else TieredStorage(profile, spec, pages)
        )
        self.page_bytes = profile.page_all_layers_bytes
        self.hbm = PageLru(profile.hbm_kv_bytes // self.page_bytes)
        self.ssd = SsdWorkers(
            profile.ssd_workers, profile.ssd_worker_bytes_per_s, profile.ssd_command_us / 1e6
        )
        self.h2d = Link(profile.h2d_gb_s * 1e9)
        self.d2h = Link(profile.h2d_gb_s * 1e9)
        staging = int(spec.host_staging * profile.host_staging_bytes)
        self.staging = StagingPool(staging, queue=not spec.revoke) if spec.host_staging else None
        budget = profile.prefetch_windows if spec.bounded_prefetch else UNBOUNDED
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_inflight_prefetches=budget,
                policy=spec.scheduler,
                hold_shared_prefixes=spec.hold_shared_prefixes,
            )
        )
        self.records = RequestRecords(len(pages))
        self.written = KeyMap()  # pages ever written to SSD: write amplification
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "ssd_read_bytes_restore",
                "ssd_read_commands_restore",
                "ssd_read_bytes_promotion",
                "ssd_bytes_delivered",
                "ssd_read_bytes_hbm_covered",  # restored pages a sibling's prefill brought
                "ssd_write_bytes",
                "ssd_pages_written_distinct",
                "h2d_bytes",
                "revoked_requests",
                "revoked_pages",
                "staging_queued",
                "resubmitted",
            ),
            0,
        )
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._flights: dict[Hashable, Flight] = {}  # by request (the scheduler's ids)
        self._gpu_busy = False

    # ---- the loop ------------------------------------------------------------------------
    def run(self, on_done: Callable[[], None] | None = None) -> RequestRecords:
        for request, when in enumerate(self.arrivals):
            self._push(float(when), ARRIVE, request)
        handlers: dict[int, Callable[[Any, float], None]] = {
            ARRIVE: self._arrive,
            PREFETCH_DONE: self._prefetch_done,
            PREFILL_DONE: self._prefill_done,
            TRANSFER_DONE: self._transfer_done,
            STAGING_FREE: self._staging_free,
        }
        while self._events:
            now, kind, _, payload = heapq.heappop(self._events)
            handlers[kind](payload, now)
            if kind == PREFILL_DONE and on_done is not None:
                on_done()
        if self._flights:
            raise RuntimeError(f"{len(self._flights)} requests never finished")  # a model bug
        return self.records

    def _push(self, when: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (when, kind, self._seq, payload))

    # ---- arrival and restore -------------------------------------------------------------
    def _arrive(self, request: int, now: float) -> None:
        digests = self.pages.digests_for(request)
        prefix = self.hbm.prefix(digests)
        _, slots = self.hbm.slots(digests[:prefix])
        self.hbm.pin(slots, +1)  # a matched prefix stays in HBM until this prefill ends
        self.hbm.touch(slots)
        located = self.storage.locate(request, digests, prefix)
        flight = Flight(request, now, prefix, slots, located, located.pages)
        self._flights[request] = flight
        names = digests["lo"][prefix:]  # a page's name on any medium (GVAs name one medium's)
        kv_bytes = located.ssd_pages * self.page_bytes
        self.scheduler.submit(
            request, now, located.gvas, kv_bytes, names[: located.pages], names[located.pages :]
        )
        self._start_prefetches(now)
        self._dispatch(now)

    def _start_prefetches(self, now: float) -> None:
        while started := self.scheduler.start_prefetches(now):
            for scheduled in started:
                self._begin_restore(self._flights[scheduled.request_id], now)

    def _begin_restore(self, flight: Flight, now: float) -> None:
        if self.staging is not None:
            need = flight.located.ssd_pages * self.page_bytes
            granted = self.staging.acquire(flight.request, need)
            if granted is False:
                self._revoke(flight, now)
                return
            flight.staged_bytes = need
            if granted is None:
                self.counters["staging_queued"] += 1
                return  # read when staging frees up (_staging_free)
        self._read(flight, now)

    def _read(self, flight: Flight, now: float) -> None:
        lengths = self.storage.ssd_reads(flight.located)
        if self.storage.keeps_restored:
            read = flight.hbm_prefix + np.flatnonzero(flight.located.unread())
            flight.restored = np.union1d(flight.restored, read)
        flight.prefetch_start = now
        self.counters["ssd_read_bytes_restore"] += int(lengths.sum())
        self.counters["ssd_read_commands_restore"] += len(lengths)
        self.records.ssd_commands[flight.request] += len(lengths)
        self._push(self.ssd.submit(now, lengths), PREFETCH_DONE, flight.request)

    def _revoke(self, flight: Flight, now: float) -> None:
        """Staging is full: drop the SSD part (and all after it) and recompute it."""
        flight.usable = flight.located.first_ssd()
        self.counters["revoked_requests"] += 1
        self.counters["revoked_pages"] += flight.located.pages - flight.usable
        self.records.revoked[flight.request] = True
        self.scheduler.prefetch_done(flight.request, now)

    def _prefetch_done(self, request: int, now: float) -> None:
        flight = self._flights[request]
        self.records.prefetch_wait[request] = now - flight.arrival
        self.records.prefetch_io[request] = now - flight.prefetch_start
        self.scheduler.prefetch_done(request, now)
        self._start_prefetches(now)
        self._dispatch(now)

    def _staging_free(self, nbytes: int, now: float) -> None:
        assert self.staging is not None  # only staged restores free staging
        for request in self.staging.release(nbytes):
            self._read(self._flights[request], now)

    # ---- prefill -------------------------------------------------------------------------
    def _dispatch(self, now: float) -> None:
        while not self._gpu_busy:
            popped = self.scheduler.pop_ready(now, 1)
            if not popped:
                return
            flight = self._flights[popped[0].request_id]
            hbm = max(flight.hbm_prefix, self.hbm.prefix(self.pages.digests_for(flight.request)))
            if self._refresh(flight, hbm, now):
                continue  # back in the scheduler for a prefetch
            self._prefill(flight, hbm, now)

    def _prefill(self, flight: Flight, hbm: int, now: float) -> None:
        request = flight.request
        planned = flight.hbm_prefix + flight.usable
        start = hbm - flight.hbm_prefix
        used = slice(start, max(start, planned - flight.hbm_prefix))
        flight.used = used
        media = flight.located.media[used]
        self.counters["ssd_read_bytes_hbm_covered"] += self._covered(flight, hbm) * self.page_bytes
        ssd_hits = int(np.count_nonzero(media))
        dram_hits = len(media) - ssd_hits
        self._attribute(request, hbm, dram_hits, ssd_hits)
        staged = ssd_hits if self.staging is not None else 0  # host-staged pages cross H2D
        h2d_bytes = (dram_hits + staged) * self.page_bytes
        self.counters["h2d_bytes"] += h2d_bytes
        self.counters["ssd_bytes_delivered"] += ssd_hits * self.page_bytes
        cached_pages = hbm + dram_hits + ssd_hits
        prompt = int(self.pages.prompt_tokens[request])
        cached = min(cached_pages * self.pages.page_tokens, max(prompt - 1, 0))
        compute = self.profile.prefill_seconds(prompt - cached, cached)
        copy = self.h2d.seconds(h2d_bytes)
        self.h2d.submit(now, h2d_bytes)
        service = max(compute, copy) + copy / self.profile.layers  # layer-pipelined load
        service += self.profile.restore_overhead_ms / 1e3 if dram_hits + ssd_hits else 0.0
        self._gpu_busy = True
        self.records.dispatch[request] = now
        self.records.compute_s[request] = compute
        self._push(now + service, PREFILL_DONE, request)
        if self.storage.saves_during_prefill:  # layer-wise puts: each layer saved as computed
            # The restore has ended: its lease goes before the put is planned, as the live
            # pipeline releases it (else the put could not drop the prefix's DRAM replica).
            transfers = self.storage.release(request, flight.located, used)
            transfers += self.storage.store(request, self.pages.digests_for(request), now)
            self._run_transfers(transfers, now, now + service)
        if flight.staged_bytes:
            self._push(now + copy, STAGING_FREE, flight.staged_bytes)

    def _covered(self, flight: Flight, hbm: int) -> int:
        """Pages this request read from SSD that its HBM prefix holds by the time it runs (a
        sibling's or an earlier turn's prefill brought them): read, never delivered."""
        if self.storage.keeps_restored:
            return int(np.count_nonzero(flight.restored < hbm))
        if math.isnan(flight.prefetch_start):
            return 0
        return int(np.count_nonzero(flight.located.media[: hbm - flight.hbm_prefix]))

    def _refresh(self, flight: Flight, hbm: int, now: float) -> bool:
        """Look storage up again as the request is dispatched (an engine matches its caches
        at schedule time): requests that were still running when this one arrived may have
        stored more of its prefix since. If more is stored now and some of it is on SSD and
        not yet in the request's slots, the request goes back for a prefetch of just that
        (once; it queues as a new arrival, since the scheduler's clock only moves forward)
        and True is returned. Otherwise it keeps the data it prefetched, or takes the fresher
        view when that needs no read (it prefetched none, or what it adds is in DRAM or was
        read by its own earlier prefetch)."""
        digests = self.pages.digests_for(flight.request)
        fresh = self.storage.locate(flight.request, digests, hbm)
        if flight.restored.size:
            fresh.have = np.isin(hbm + np.arange(fresh.pages), flight.restored)
        planned = flight.hbm_prefix + flight.usable
        grew = hbm + fresh.pages > planned
        revoked = bool(self.records.revoked[flight.request])  # revoked means recomputed
        if grew and fresh.ssd_pages_to_read and not flight.resubmitted and not revoked:
            self._drop_restore(flight, now)
            flight.located, flight.hbm_prefix, flight.usable = fresh, hbm, fresh.pages
            flight.resubmitted = True
            self.counters["resubmitted"] += 1
            kv_bytes = fresh.ssd_pages_to_read * self.page_bytes
            names = digests["lo"][hbm:]
            located, computed = names[: fresh.pages], names[fresh.pages :]
            self.scheduler.submit(flight.request, now, fresh.gvas, kv_bytes, located, computed)
            self._start_prefetches(now)
            return True
        if grew and fresh.have is not None and not fresh.ssd_pages_to_read and not revoked:
            self._drop_restore(flight, now)  # the growth is in DRAM or already in its slots
            flight.located, flight.hbm_prefix, flight.usable = fresh, hbm, fresh.pages
            return False
        if flight.located.ssd_pages == 0:
            self._drop_restore(flight, now)
            flight.located, flight.hbm_prefix = fresh, hbm
            flight.usable = fresh.first_ssd()  # SSD pages found now would need a prefetch
        else:
            self.storage.release(flight.request, fresh, slice(0, 0))
        return False

    def _look_again(self, flight: Flight, now: float) -> None:
        """Its prefetch was held until the prefill of an earlier request sharing its SSD
        pages ended (core/prefix_holds.py). Look HBM and storage up again: what that prefill
        brought into HBM needs no read; the scheduler gets what is still to read."""
        digests = self.pages.digests_for(flight.request)
        hbm = self.hbm.prefix(digests)
        if hbm <= flight.hbm_prefix:
            return  # nothing more in HBM: it prefetches what it located
        _, slots = self.hbm.slots(digests[:hbm])
        self.hbm.pin(slots, +1)
        self.hbm.touch(slots)
        self.hbm.pin(flight.hbm_slots, -1)
        flight.hbm_slots = slots
        fresh = self.storage.locate(flight.request, digests, hbm)
        if flight.restored.size:
            fresh.have = np.isin(hbm + np.arange(fresh.pages), flight.restored)
        self._drop_restore(flight, now)
        flight.located, flight.hbm_prefix, flight.usable = fresh, hbm, fresh.pages
        unread = fresh.unread()
        kv_bytes = int(np.count_nonzero(unread)) * self.page_bytes
        names = digests["lo"][hbm : hbm + fresh.pages][unread]
        self.scheduler.update(flight.request, now, fresh.gvas[unread], kv_bytes, names)

    def _drop_restore(self, flight: Flight, now: float) -> None:
        self.storage.release(flight.request, flight.located, slice(0, 0))
        if flight.staged_bytes:
            staged, flight.staged_bytes = flight.staged_bytes, 0
            self._staging_free(staged, now)

    def _attribute(self, request: int, hbm: int, dram_hits: int, ssd_hits: int) -> None:
        reusable = int(self.pages.reusable[request])
        counted = min(hbm, reusable)
        records = self.records
        records.hbm[request] = counted
        records.late[request] = hbm - counted
        records.dram[request] = dram_hits
        records.ssd[request] = ssd_hits
        records.miss[request] = reusable - counted - dram_hits - ssd_hits

    def _prefill_done(self, request: int, now: float) -> None:
        self._gpu_busy = False
        flight = self._flights.pop(request)
        digests = self.pages.digests_for(request)
        self.hbm.insert(digests)
        self.hbm.pin(flight.hbm_slots, -1)
        self.scheduler.finished(request, now)
        if released := self.scheduler.take_released():
            for scheduled in released:
                self._look_again(self._flights[scheduled.request_id], now)
            self._start_prefetches(now)
        if not self.storage.saves_during_prefill:  # else released as the prefill started
            transfers = self.storage.release(request, flight.located, flight.used)
            self._run_transfers(transfers + self.storage.store(request, digests, now), now)
        self.records.done[request] = now
        self.records.arrival[request] = flight.arrival
        self._dispatch(now)

    # ---- background transfers ------------------------------------------------------------
    def _run_transfers(
        self, transfers: list[Transfer], now: float, not_before: float = 0.0
    ) -> None:
        """Start ``transfers``; one with a token completes when its I/O is done, and not
        before ``not_before`` (a put's keys never appear before its prefill has ended)."""
        for transfer in transfers:
            if transfer.kind == "ssd-write":
                done = self.ssd.submit(now, transfer.lengths, write=True)
                self.counters["ssd_write_bytes"] += int(transfer.lengths.sum())
                if transfer.digests is not None and len(transfer.digests):
                    fresh = self.written.add_new(transfer.digests["lo"])
                    self.counters["ssd_pages_written_distinct"] += fresh
            elif transfer.kind == "ssd-read":
                done = self.ssd.submit(now, transfer.lengths)
                self.counters["ssd_read_bytes_promotion"] += int(transfer.lengths.sum())
            else:
                done = self.d2h.submit(now, int(transfer.lengths.sum()))
            if transfer.token is not None:
                self._push(max(done, not_before), TRANSFER_DONE, transfer)

    def _transfer_done(self, transfer: Transfer, now: float) -> None:
        self.storage.complete(transfer)
