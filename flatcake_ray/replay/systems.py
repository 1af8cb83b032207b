"""The compared systems: each one a configuration of shared code, not a rewrite.

Every system runs the same engine loop (``engine.py``) with the same GPU HBM prefix cache,
the same devices and the live FC-MAS :class:`~flatcake_ray.scheduler.Scheduler`. What
differs is the storage behind HBM and a few switches:

=============== ===========================================================================
recompute       HBM only: every page not in HBM is recomputed.
dram-only       HBM + a host DRAM LRU (SGLang HiCache L2): new pages are written through to
                DRAM, evicted pages are dropped.
tiered          Mooncake-like: DRAM LRU first; DRAM evictions go to SSD in FIFO buckets
                shared by all sessions (a recycled bucket drops every page in it); an SSD hit
                is read as page objects into host staging that is held for the whole in-flight
                prefix until its H2D copy is done; a restore that finds the staging pool full
                is revoked and its pages recomputed; SSD hits are promoted into DRAM (re-read
                from SSD, paper Figure 5(c)(i)).
tiered-gds      the same tiers, SSD hits read by GDS straight into HBM page slots: one command
                per (page, layer), because the eviction-ordered page-major layout puts a
                layer's pages far apart. No host staging, no promotion.
tiered-tuned    tiered with 4x the staging pool, restores queued (never revoked) for it.
tiered-aware    tiered-tuned whose DRAM evicts and admits by predicted reuse (a Bidaw-like
                workload-aware tiered cache, ``aware.py``).
flatcake        the live :class:`~flatcake_ray.catalog.Catalog` (placement, extents,
                reclamation), its reads laid out by the live reader's descriptor function and
                merged by the live ``coalesce``, per layer as the live restore pipeline does,
                at most ``prefetch_windows`` restores at once, FC-MAS HRRN order.
                Its DRAM policy is the placement module's default (``replica``).
flatcake-table2 flatcake with the paper's Table 2 only (no DRAM read replicas).
flatcake-admit  flatcake admitting SSD-bound later turns to DRAM while it has headroom.
flatcake-fcfs   flatcake with the scheduler's ``fcfs`` policy (paper's w/o FC-MAS ablation).
flatcake-nohold flatcake without the scheduler's shared-prefix hold (its ablation).
oracle          flatcake whose placement knows each page's next use (from the trace): pages
                never used again are not stored; a put whose next use is within
                ``oracle_horizon_s`` goes to DRAM while DRAM stays under its low watermark
                (so reclamation never drops what will be reused), the rest to SSD. A
                reference point, not an optimum: capacity is still reclaimed oldest-first.
=============== ===========================================================================

Dispatch. The tiered systems dispatch whichever requests have their data, oldest first, and
start every restore at arrival (SGLang's wait-for-prefetch behaviour): the shared scheduler
with an unbounded prefetch budget. FlatCake bounds restores by its GPU windows and orders
them by HRRN, holding a prefetch of pages an older unfinished request will bring into HBM
until that request's prefill ends; flatcake-fcfs dispatches strictly in arrival order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from flatcake_ray.config_store import DRAM_POLICIES
from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import ConfigError

STORAGE_KINDS = ("flat", "tiered")
SSD_READS = ("extents", "objects", "page-layer")


@dataclass(frozen=True)
class SystemSpec:
    name: str
    storage: str  # flat | tiered
    dram: bool = True
    ssd: bool = True
    scheduler: str = "fc-mas"  # the shared scheduler's policy
    bounded_prefetch: bool = False  # True: at most profile.prefetch_windows restores at once
    ssd_read: str = "extents"
    host_staging: float = 0.0  # x profile.host_staging_bytes; 0 = restores skip host memory
    revoke: bool = False  # staging full: revoke (True) or queue (False)
    promote: bool = False  # SSD hits are re-read and inserted into DRAM
    oracle: bool = False
    oracle_horizon_s: float = 60.0
    fifo_buckets: int = 64
    dram_policy: str | None = None  # flat: overrides PlacementConfig.dram_policy
    dram_order: str = "lru"  # tiered: lru | predicted (eviction and admission, aware.py)
    # The scheduler holds a prefetch of SSD pages an earlier unfinished request will bring
    # into HBM (core/prefix_holds.py); FlatCake's scheduler does, the baselines do not.
    hold_shared_prefixes: bool = False

    def __post_init__(self) -> None:
        if self.storage not in STORAGE_KINDS:
            raise ConfigError(f"storage must be one of {STORAGE_KINDS}")
        if self.ssd_read not in SSD_READS:
            raise ConfigError(f"ssd_read must be one of {SSD_READS}")
        if self.host_staging < 0 or self.fifo_buckets < 1 or self.oracle_horizon_s < 0:
            raise ConfigError("host_staging, oracle_horizon_s >= 0 and fifo_buckets >= 1")
        if self.storage == "flat" and (self.host_staging or self.promote):
            raise ConfigError("flat storage has no host staging and never promotes")
        if self.dram_order not in ("lru", "predicted"):
            raise ConfigError("dram_order must be lru or predicted")
        if self.dram_policy is not None and self.dram_policy not in DRAM_POLICIES:
            raise ConfigError(f"dram_policy must be one of {DRAM_POLICIES}")


SYSTEMS: dict[str, SystemSpec] = {
    "recompute": SystemSpec("recompute", "tiered", dram=False, ssd=False),
    "dram-only": SystemSpec("dram-only", "tiered", ssd=False),
    "tiered": SystemSpec(
        "tiered", "tiered", ssd_read="objects", host_staging=1.0, revoke=True, promote=True
    ),
    "tiered-gds": SystemSpec("tiered-gds", "tiered", ssd_read="page-layer"),
    "tiered-tuned": SystemSpec(
        "tiered-tuned", "tiered", ssd_read="objects", host_staging=4.0, promote=True
    ),
    "tiered-aware": SystemSpec(
        "tiered-aware",
        "tiered",
        ssd_read="objects",
        host_staging=4.0,
        promote=True,
        dram_order="predicted",
    ),
    "flatcake": SystemSpec("flatcake", "flat", bounded_prefetch=True, hold_shared_prefixes=True),
    "flatcake-table2": SystemSpec(
        "flatcake-table2",
        "flat",
        bounded_prefetch=True,
        dram_policy="table2",
        hold_shared_prefixes=True,
    ),
    "flatcake-admit": SystemSpec(
        "flatcake-admit",
        "flat",
        bounded_prefetch=True,
        dram_policy="admit",
        hold_shared_prefixes=True,
    ),
    "flatcake-fcfs": SystemSpec(
        "flatcake-fcfs", "flat", scheduler="fcfs", bounded_prefetch=True, hold_shared_prefixes=True
    ),
    "oracle": SystemSpec(
        "oracle", "flat", bounded_prefetch=True, oracle=True, hold_shared_prefixes=True
    ),
    # flatcake without the shared-prefix hold (the ablation of prefix_holds.py)
    "flatcake-nohold": SystemSpec("flatcake-nohold", "flat", bounded_prefetch=True),
}


def get_system(name: str | SystemSpec) -> SystemSpec:
    if isinstance(name, SystemSpec):
        return name
    if name not in SYSTEMS:
        raise ConfigError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    return SYSTEMS[name]


@dataclass
class Located:
    """What storage holds of a request past its HBM prefix, found at arrival."""

    media: np.ndarray  # per page of the leading run: Medium value (0 DRAM, 1 SSD)
    gvas: np.ndarray  # per page, uint64, for the scheduler's medium check
    handle: Any = None  # storage-private: a lease, pinned slots
    # Per page: already in the request's KV slots (restored by an earlier prefetch of the
    # same request, before it went back to the scheduler), so never read again; None: none.
    have: np.ndarray | None = None

    @property
    def pages(self) -> int:
        return len(self.media)

    @property
    def ssd_pages(self) -> int:
        return int(np.count_nonzero(self.media))

    def first_ssd(self) -> int:
        hits = np.flatnonzero(self.media)
        return int(hits[0]) if hits.size else self.pages

    def unread(self) -> np.ndarray:
        """Per page: on SSD and not yet in the request's slots (what a prefetch must read)."""
        on_ssd = self.media != 0
        return on_ssd if self.have is None else on_ssd & ~self.have

    @property
    def ssd_pages_to_read(self) -> int:
        return int(np.count_nonzero(self.unread()))

    def first_unread(self) -> int:
        hits = np.flatnonzero(self.unread())
        return int(hits[0]) if hits.size else self.pages


@dataclass
class Transfer:
    """Background I/O a storage asks the engine to run; ``token`` comes back on completion."""

    kind: str  # ssd-write | ssd-read | d2h
    lengths: np.ndarray  # bytes per command
    token: Any = None
    digests: np.ndarray | None = None  # pages written to SSD (write amplification)
    medium: Medium = Medium.SSD


@dataclass
class StorageCounters:
    values: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, amount: int = 1) -> None:
        self.values[key] = self.values.get(key, 0) + int(amount)


class Storage(Protocol):
    counters: StorageCounters
    # store() (and release() of the request's lookup) is called as the prefill starts, not
    # as it ends
    saves_during_prefill: bool
    # Restored pages land in the request's own KV slots and stay there if the request goes
    # back to the scheduler (FlatCake's GPU windows); False: they sit in host staging, which
    # is given back, so a second prefetch reads them again (tiered systems).
    keeps_restored: bool

    def locate(self, request: int, digests: np.ndarray, start: int) -> Located: ...

    def ssd_reads(self, located: Located) -> np.ndarray: ...

    def release(self, request: int, located: Located, used: slice) -> list[Transfer]: ...

    def store(self, request: int, digests: np.ndarray, now: float) -> list[Transfer]: ...

    def complete(self, transfer: Transfer) -> None: ...

    def report(self) -> dict[str, Any]: ...
