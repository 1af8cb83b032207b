"""A request in flight in the replay model: what it found where, and how far it got."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from flatcake_ray.replay.systems import Located


@dataclass
class Flight:
    request: int
    arrival: float
    hbm_prefix: int
    hbm_slots: np.ndarray
    located: Located
    usable: int  # storage pages usable from the HBM prefix on (cut short by a revoke)
    staged_bytes: int = 0
    prefetch_start: float = math.nan
    resubmitted: bool = False
    used: slice = field(default_factory=lambda: slice(0, 0))
    # Request positions of the pages its prefetches read into its own KV slots (storage
    # that keeps restored pages only): a second prefetch does not read them again.
    restored: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
