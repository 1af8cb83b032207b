"""Modelled devices on the virtual clock: SSD workers, a PCIe link, a host staging pool.

Each device is a set of FIFO servers with a "free at" time, so a transfer's completion time
is known when it is submitted (exact for FIFO service) and the event loop needs one event per
transfer, not one per command.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from flatcake_ray.errors import ConfigError


@dataclass
class DeviceCounters:
    commands: int = 0
    bytes: int = 0
    busy_s: float = 0.0  # summed over servers


class SsdWorkers:
    """``workers`` I/O workers, each a FIFO server: a command costs ``command_s`` plus its
    bytes at ``bytes_per_s``. A transfer's commands are striped round-robin over the workers
    (as FC-CIO stripes merged reads, paper 3.4); reads and writes share the workers."""

    def __init__(self, workers: int, bytes_per_s: float, command_s: float) -> None:
        if workers < 1 or bytes_per_s <= 0 or command_s < 0:
            raise ConfigError("SSD workers need workers >= 1, bandwidth > 0, command cost >= 0")
        self.free_at = np.zeros(workers)
        self.bytes_per_s = bytes_per_s
        self.command_s = command_s
        self.reads = DeviceCounters()
        self.writes = DeviceCounters()
        self._next = 0

    def submit(self, now: float, lengths: np.ndarray, *, write: bool = False) -> float:
        """Completion time of commands of ``lengths`` bytes issued at ``now``."""
        if not len(lengths):
            return now
        workers = len(self.free_at)
        lane = (self._next + np.arange(len(lengths))) % workers
        self._next = int((self._next + len(lengths)) % workers)
        cost = self.command_s + lengths / self.bytes_per_s
        per_lane = np.bincount(lane, weights=cost, minlength=workers)
        active = per_lane > 0
        start = np.maximum(self.free_at, now)
        self.free_at[active] = start[active] + per_lane[active]
        counters = self.writes if write else self.reads
        counters.commands += len(lengths)
        counters.bytes += int(lengths.sum())
        counters.busy_s += float(per_lane.sum())
        return float(self.free_at[active].max())


class Link:
    """One direction of a PCIe link: a single FIFO server at ``bytes_per_s``."""

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ConfigError("a link needs bandwidth > 0")
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0
        self.counters = DeviceCounters()

    def seconds(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_s

    def submit(self, now: float, nbytes: int) -> float:
        if nbytes <= 0:
            return now
        self.free_at = max(self.free_at, now) + nbytes / self.bytes_per_s
        self.counters.commands += 1
        self.counters.bytes += nbytes
        self.counters.busy_s += nbytes / self.bytes_per_s
        return self.free_at


class StagingPool:
    """Host staging for tiered restores: a restore holds its whole SSD prefix's bytes here
    from the start of its SSD read until its H2D copy is done.

    ``queue=False`` (Mooncake/SGLang): a restore that does not fit is revoked at once.
    ``queue=True`` (the tuned baseline): it waits, first come first served, without backfill;
    a restore larger than the whole pool starts alone once the pool is empty.
    """

    def __init__(self, capacity: int, queue: bool) -> None:
        if capacity < 0:
            raise ConfigError("staging capacity must be >= 0")
        self.capacity = capacity
        self.queue = queue
        self.used = 0
        self.peak = 0
        self.waiting: deque[tuple[int, int]] = deque()  # (request, bytes)

    def _fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.capacity or (self.used == 0 and self.queue)

    def acquire(self, request: int, nbytes: int) -> bool | None:
        """True: granted; False: revoked; None: queued (granted later by :meth:`release`)."""
        if not self.waiting and self._fits(nbytes):
            self._take(nbytes)
            return True
        if not self.queue:
            return False
        self.waiting.append((request, nbytes))
        return None

    def release(self, nbytes: int) -> list[int]:
        """Give back ``nbytes``; returns the queued requests granted now, in order."""
        self.used -= nbytes
        granted = []
        while self.waiting and self._fits(self.waiting[0][1]):
            request, size = self.waiting.popleft()
            self._take(size)
            granted.append(request)
        return granted

    def _take(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)
