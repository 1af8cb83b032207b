"""The workload-aware tiered baseline (``tiered-aware``), in the spirit of Bidaw (FAST'26):
a DRAM tier that keeps what is predicted to come back soonest, and admits by predicted reuse.

Bidaw's storage side predicts when a conversation's KV will be read again from what the
model has seen of that conversation, evicts accordingly, and keeps only what is worth its
footprint. Here, per session (the model has the trace's session ids, inferred for Mooncake):

- *When*: ``ReusePredictor`` keeps an exponential moving average of each session's gaps
  between requests (agent steps come seconds apart, chat turns minutes apart); a session
  seen once is given the average first gap of sessions that did come back. Its next use is
  predicted at its last request plus that gap.
- *Whether*: a session is *overdue* once twice its predicted gap has passed with no request
  (most chat sessions end after one turn; an agent that finished stops calling).
- *Eviction* (``PredictedLru``): overdue sessions' pages first (least recently used first),
  then the pages whose session is predicted back furthest in the future; within a session
  its tail first, as in the plain LRU.
- *Admission*: a first turn (no history yet) is written through to DRAM only while DRAM has
  free slots or sessions come back often (more than half of them); otherwise it goes
  straight to the SSD tier, so one-shot chat prompts do not push out live sessions.

Everything else is ``tiered-tuned``: a 4x host staging pool, restores queued (not revoked),
SSD hits promoted into DRAM, and the shared scheduler (Bidaw's compute side, requests split
by the tier their KV is on and ordered by KV size, is what FC-MAS's HRRN already does).
"""

from __future__ import annotations

import numpy as np

from flatcake_ray.replay.tiers import PageLru

OVERDUE_FACTOR = 2.0
EMA_WEIGHT = 0.3


class ReusePredictor:
    """Per-session gap estimates from the times a session's requests were served."""

    def __init__(self, sessions: int) -> None:
        size = max(sessions, 1)
        self.last = np.full(size, np.nan)
        self.gap = np.full(size, np.nan)
        self.first_gaps = 0.0
        self.returned = 0
        self.seen = 0

    def observe(self, session: int, now: float) -> None:
        if session < 0:
            return
        last = self.last[session]
        if np.isnan(last):
            self.seen += 1
        else:
            gap = max(now - last, 1e-3)
            if np.isnan(self.gap[session]):
                self.returned += 1
                self.first_gaps += gap
                self.gap[session] = gap
            else:
                self.gap[session] += EMA_WEIGHT * (gap - self.gap[session])
        self.last[session] = now

    @property
    def return_rate(self) -> float:
        return self.returned / self.seen if self.seen else 1.0

    def next_use(self, sessions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(predicted next use, predicted gap) per session code (-1: unknown, never back)."""
        default_gap = self.first_gaps / self.returned if self.returned else 60.0
        known = sessions >= 0
        codes = np.where(known, sessions, 0)
        gap = np.where(np.isnan(self.gap[codes]), default_gap, self.gap[codes])
        last = np.where(known, self.last[codes], -np.inf)
        last = np.where(np.isnan(last), -np.inf, last)
        return last + gap, gap


class PredictedLru(PageLru):
    """A :class:`PageLru` that evicts by predicted next use (see the module docstring)."""

    def __init__(self, capacity: int, predictor: ReusePredictor) -> None:
        super().__init__(capacity)
        self.predictor = predictor
        self.now = 0.0

    def insert(self, digests: np.ndarray, owner: int = -1) -> tuple[np.ndarray, np.ndarray]:
        found, slots = self.slots(digests)
        self.owner[slots[found]] = owner  # the session that used a page last owns it
        return super().insert(digests, owner)

    def _choose(self, candidates: np.ndarray, want: int) -> np.ndarray:
        next_use, gap = self.predictor.next_use(self.owner[candidates])
        overdue = self.now > next_use + (OVERDUE_FACTOR - 1.0) * gap
        # lexsort: last key first. Overdue first; then furthest predicted use; then LRU.
        order = np.lexsort((self.stamp[candidates], -next_use, ~overdue))
        return candidates[order[:want]]

    def admits_first_turn(self, pages: int) -> bool:
        free = self.capacity - len(self)
        return pages <= free or self.predictor.return_rate > 0.5
