"""The one workload every system runs, its seeded bytes and the byte checks on every side."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flatcake_ray.cli.benchkit import seeded_pages

TOKENS_PER_PAGE = 16  # LMCache counts tokens; a page holds this many (K and V halves)
# Lookups each system's control figure is the median of (cold and warm each, where it has
# both): a lookup takes 1-3 ms, so 11 cost nothing beside the restores, and a median of 5 moved
# with every other process's step.
CONTROL_SAMPLES = 11


class ByteMismatch(AssertionError):
    """A system returned bytes that differ from what was put: the run fails."""


@dataclass(frozen=True)
class Workload:
    pages: int = 3421
    layers: int = 4
    page_bytes: int = 16 << 10
    rounds: int = 3  # timed rounds per measurement (medians); one untimed warm-up first

    def __post_init__(self) -> None:
        if self.pages < 1 or self.layers < 1 or self.rounds < 1:
            raise ValueError("pages, layers and rounds must be positive")
        if self.page_bytes % (4 * TOKENS_PER_PAGE):
            raise ValueError(f"page_bytes must be a multiple of {4 * TOKENS_PER_PAGE}")

    @property
    def nbytes(self) -> int:
        return self.layers * self.pages * self.page_bytes

    @property
    def object_bytes(self) -> int:
        """One page of every layer: one key-value object for the object stores."""
        return self.layers * self.page_bytes

    def kv(self, seed: int, pages: int | None = None) -> np.ndarray:
        """``[layers, pages, page_bytes]`` uint8, the same in every process for a seed."""
        return seeded_pages(
            self.layers, self.pages if pages is None else pages, self.page_bytes, seed
        )

    def keys(self, name: str, pages: int | None = None) -> list[str]:
        return [f"{name}-{i}" for i in range(self.pages if pages is None else pages)]


def check_bytes(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Raise :class:`ByteMismatch` unless ``got`` equals ``expected`` byte for byte."""
    if got.shape != expected.shape or not np.array_equal(got, expected):
        bad = int(np.count_nonzero(got != expected)) if got.shape == expected.shape else -1
        raise ByteMismatch(f"{what}: {bad} bytes differ from what was put")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def start_gate(clients: int) -> float:
    """A wall-clock time just after every client of a concurrent round has its call (the
    processes share this machine's clock): they start together, not as each call happens to
    arrive, and no client makes or checks bytes while another is timed."""
    return time.time() + 0.05 + 0.01 * clients


def wait_until(start_at: float | None) -> None:
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))


def aggregate(runs: list[dict[str, Any]]) -> float:
    """Bytes of all concurrent requests over the span from the first start to the last end."""
    span = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    return gbps(sum(r["bytes"] for r in runs), span)


class PreparedBytes:
    """A client's seeded bytes made before a concurrent round (``start_gate``), so its timed
    calls overlap only the others' timed calls, not another client making or checking 33 MB
    (several times a restore). Bytes not made ahead are made when asked."""

    def __init__(self, workload: Workload) -> None:
        self._workload = workload
        self._made: dict[tuple[str, int], np.ndarray] = {}

    def make(self, session: str, pages: int, seed: int) -> None:
        self._made[(session, pages)] = self._workload.kv(seed, pages)

    def of(self, session: str, pages: int, seed: int) -> np.ndarray:
        """``session``'s bytes, kept (what its restores are checked against)."""
        made = self._made.get((session, pages))
        return self._workload.kv(seed, pages) if made is None else made

    def take(self, session: str, pages: int, seed: int) -> np.ndarray:
        """``session``'s bytes, forgotten here (a put's, used once)."""
        made = self._made.pop((session, pages), None)
        return self._workload.kv(seed, pages) if made is None else made
