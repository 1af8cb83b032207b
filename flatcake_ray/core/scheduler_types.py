"""What FC-MAS's callers see: its configuration, request record (checked), phases and statistics
(``scheduler.py`` holds the scheduler and its contract)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import Enum
from numbers import Integral, Real

import numpy as np

from flatcake_ray.core.gva import Medium, slowest_medium
from flatcake_ray.errors import ConfigError, InvalidRequestError

RequestId = Hashable
POLICIES = ("fc-mas", "fcfs")


def response_ratio(wait: float, kv_bytes: int) -> float:
    """Paper Eq. 1, ``1 + wait / kv_bytes``; a zero-byte request counts as one byte."""
    return 1.0 + wait / max(kv_bytes, 1)


@dataclass(frozen=True)
class SchedulerConfig:
    max_inflight_prefetches: int = 4
    max_inflight_bytes: int | None = None  # staging window; None: count limit only
    policy: str = "fc-mas"  # "fc-mas" or "fcfs"
    starvation_limit: float | None = None  # seconds; None: pure HRRN
    # Hold a prefetch of SSD pages an earlier unfinished request will bring into HBM (the
    # caller then reports finished() and re-looks up released requests); prefix_holds.py.
    hold_shared_prefixes: bool = False

    def __post_init__(self) -> None:
        if not is_int(self.max_inflight_prefetches) or self.max_inflight_prefetches < 1:
            raise ConfigError("max_inflight_prefetches must be an integer >= 1")
        window = self.max_inflight_bytes
        if window is not None and (not is_int(window) or window < 1):
            raise ConfigError("max_inflight_bytes must be None or an integer >= 1")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, not {self.policy!r}")
        limit = self.starvation_limit
        if limit is not None and not (is_real(limit) and math.isfinite(limit) and limit >= 0):
            raise ConfigError("starvation_limit must be None or a finite number >= 0")
        if type(self.hold_shared_prefixes) is not bool:
            raise ConfigError("hold_shared_prefixes must be a bool")


@dataclass(frozen=True)
class SchedulerStats:
    ready: int
    waiting_prefetch: int
    inflight_prefetches: int
    inflight_bytes: int
    max_inflight_prefetches_seen: int
    max_inflight_bytes_seen: int
    prefetches_started: int
    prefetches_completed: int
    dispatched_dram: int
    dispatched_ssd: int
    cancelled: int
    mean_wait_dram: float  # arrival -> dispatch, seconds; 0.0 before the first
    max_wait_dram: float
    mean_wait_ssd: float
    max_wait_ssd: float
    mean_prefetch_queue_wait: float  # arrival -> prefetch start
    max_prefetch_queue_wait: float
    held: int = 0  # requests held now behind an earlier one sharing SSD pages
    holds: int = 0  # times a request was held
    released: int = 0  # holds ended (the holder finished or was cancelled)


class Phase(Enum):
    HELD = "held"  # SSD request whose prefetch waits for an earlier one sharing its SSD pages
    WAITING = "waiting"  # SSD request whose prefetch has not started
    PREFETCHING = "prefetching"
    READY = "ready"


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request_id: RequestId
    arrival: float
    kv_bytes: int  # SSD bytes to prefetch; 0 for a DRAM-ready request
    medium: Medium  # slowest medium its hits touch


# The exact-type tests first: ABC isinstance checks are a third of a replay run's time.
def is_int(value: object) -> bool:
    return type(value) is int or (isinstance(value, Integral) and not isinstance(value, bool))


def is_real(value: object) -> bool:
    return type(value) is float or (isinstance(value, Real) and not isinstance(value, bool))


def checked_request(
    request_id: RequestId,
    arrival: float,
    gvas: np.ndarray | Sequence[int],
    kv_bytes: int,
    pages: np.ndarray | Sequence[Hashable] | None,
) -> ScheduledRequest:
    """The record of a request, its fields checked (``InvalidRequestError`` else)."""
    medium = _classify(gvas)
    if not is_int(kv_bytes) or kv_bytes < 0:
        raise InvalidRequestError(f"kv_bytes must be an integer >= 0, not {kv_bytes!r}")
    if medium is Medium.DRAM and kv_bytes:
        raise InvalidRequestError(f"request {request_id!r} has no SSD hit but kv_bytes > 0")
    if pages is not None and len(pages) != len(gvas):
        raise InvalidRequestError(f"{len(pages)} page names for {len(gvas)} GVAs")
    return ScheduledRequest(request_id, arrival, int(kv_bytes), medium)


def _classify(gvas: np.ndarray | Sequence[int]) -> Medium:
    try:
        return slowest_medium(gvas if isinstance(gvas, np.ndarray) else list(gvas))
    except (OverflowError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"GVAs must be unsigned 64-bit integers: {exc}") from exc
