"""Session and turn inference for traces without session ids (Mooncake).

Rule. Block ids are prefix-chained (a block id stands for its whole token prefix), so the
blocks a request shares with all earlier requests are a prefix of its block list; call its
last block the request's *deepest shared block* ``b``. Then:

* no shared block, or ``b`` is a *common* block -> the request starts a new session, turn 1;
* otherwise it continues the session of the most recent earlier request that contains ``b``
  (its *parent*), with turn = parent's turn + 1.

A block is *common* when, over the whole trace, at least ``common_fanout`` (default 32)
distinct blocks follow it: a system prompt shared by thousands of conversations (Mooncake's
block 0 has 7,373 successors), not a session's own history (the largest fan-out of any
other Mooncake block is 11: a long conversation whose partial last block changes each turn).
The result does not move for any threshold from 16 to 1,000 on the shared Mooncake
conversation trace: 7,373 sessions. The threshold is a property of the whole trace, so
inference needs the trace's end before it can name sessions (two passes over per-request
numbers, one pass over the blocks).

"Most recent earlier request that contains ``b``" rather than "whose whole block list is a
prefix": a turn's last block is usually partial and is re-hashed when the next turn fills it,
so the previous turn's whole list is almost never a prefix of the next one. Branches (a
regenerated reply, a sub-agent replaying the session prefix) join the session they branch
from.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from flatcake_ray.traces.blockindex import BlockIndex
from flatcake_ray.traces.records import Trace, TraceRequest

DEFAULT_COMMON_FANOUT = 32


@dataclass(frozen=True)
class SessionInference:
    """Inferred session of every request (codes ``0..sessions-1`` in order of first request)."""

    session_of_request: np.ndarray
    turn_of_request: np.ndarray
    common_fanout: int

    @property
    def sessions(self) -> int:
        if self.session_of_request.size == 0:
            return 0
        return int(self.session_of_request.max()) + 1

    def session_names(self) -> list[str]:
        return [f"inferred-{code}" for code in range(self.sessions)]


class SessionInferrer:
    """Collects, request by request, what inference needs; :meth:`resolve` names sessions."""

    def __init__(self) -> None:
        self._shared: list[int] = []
        self._deepest: list[int] = []
        self._parent: list[int] = []

    def observe(self, codes: np.ndarray, previous_request: np.ndarray, index: BlockIndex) -> None:
        """Record one request, before ``index.last_request`` is updated for it.

        ``codes`` are the request's dense block codes (no repeats), ``previous_request`` the
        last request of each (``-1`` = never seen). Also counts block fan-out into ``index``.
        """
        seen = previous_request >= 0
        shared = codes.size if bool(seen.all()) else int(np.argmin(seen))
        self._shared.append(shared)
        if shared == 0:
            self._deepest.append(-1)
            self._parent.append(-1)
        else:
            self._deepest.append(int(codes[shared - 1]))
            self._parent.append(int(previous_request[shared - 1]))
        first_seen_next = ~seen[1:]
        index.fanout[codes[:-1][first_seen_next]] += 1

    def resolve(
        self, index: BlockIndex, common_fanout: int = DEFAULT_COMMON_FANOUT
    ) -> SessionInference:
        if common_fanout < 1:
            raise ValueError(f"common_fanout must be >= 1, got {common_fanout}")
        count = len(self._shared)
        deepest = np.asarray(self._deepest, dtype=np.int64)
        parents = np.asarray(self._parent, dtype=np.int64)
        fanout_of_deepest = np.where(deepest >= 0, index.fanout[np.maximum(deepest, 0)], 0)
        continues = (deepest >= 0) & (fanout_of_deepest < common_fanout)
        sessions = np.empty(count, dtype=np.int32)
        turns = np.empty(count, dtype=np.int32)
        next_session = 0
        # Sequential by nature (a parent's session must be known first), but only over
        # per-request ints: ~100K iterations, not one per block.
        for request, parent in enumerate(parents.tolist()):
            if continues[request]:
                sessions[request] = sessions[parent]
                turns[request] = turns[parent] + 1
            else:
                sessions[request] = next_session
                turns[request] = 1
                next_session += 1
        return SessionInference(sessions, turns, common_fanout)


def infer_sessions(
    requests: Iterable[TraceRequest], common_fanout: int = DEFAULT_COMMON_FANOUT
) -> SessionInference:
    """Infer sessions and turns of ``requests`` (in arrival order) from their prefix chains."""
    index = BlockIndex()
    inferrer = SessionInferrer()
    accesses = 0
    for request_no, request in enumerate(requests):
        codes = index.distinct(index.codes_of(request.blocks, accesses))
        accesses += codes.size
        previous = index.last_request[codes]
        inferrer.observe(codes, previous, index)
        index.last_request[codes] = request_no
    return inferrer.resolve(index, common_fanout)


def with_inferred_sessions(trace: Trace, common_fanout: int = DEFAULT_COMMON_FANOUT) -> Trace:
    """A copy of ``trace`` whose sessions and turns are the inferred ones."""
    inference = infer_sessions(trace, common_fanout)
    return trace.with_sessions(
        inference.session_of_request, inference.session_names(), inference.turn_of_request
    )
