"""Placing staggered sessions on one clock so requests interleave by a chosen amount.

Reuse distance in an agentic trace is mostly *how many other sessions' requests land
between two consecutive requests of one session* (within a session, each request replays
the whole prefix the previous one read). So the start spacing of staggered sessions is
solved for directly on that quantity: the context-weighted mean, over requests, of the
number of requests in between a request and its session's previous request. Solving it on
the sessions actually planned (their real durations, sub-agent bursts and edge effects)
keeps it on target from four sessions to four hundred.
"""

from __future__ import annotations

import numpy as np

_BISECTION_STEPS = 40


def stagger_starts(
    request_session: np.ndarray,
    request_time: np.ndarray,
    request_weight: np.ndarray,
    durations: np.ndarray,
    target_between: float,
    jitter: np.ndarray,
) -> np.ndarray:
    """Start times of sessions ``0..len(durations)-1``, spaced ``(i + jitter_i) * s``.

    ``request_*`` describe every request of these sessions on its session's own clock;
    ``s`` is chosen so the weighted mean number of requests between consecutive requests
    of a session is ``target_between`` (as near as bisection gets).
    """
    sessions = durations.size
    if sessions < 2 or target_between <= 0:
        return np.arange(sessions) * (float(durations.max(initial=0.0)) + 1.0)
    by_session = np.lexsort((request_time, request_session))
    same = request_session[by_session][1:] == request_session[by_session][:-1]
    earlier, later = by_session[:-1][same], by_session[1:][same]
    weights = request_weight[later].astype(np.float64)
    total_weight = max(float(weights.sum()), 1e-12)

    def between(spacing: float) -> float:
        starts = (np.arange(sessions) + jitter) * spacing
        order = np.argsort(starts[request_session] + request_time, kind="stable")
        position = np.empty_like(order)
        position[order] = np.arange(order.size)
        gaps = position[later] - position[earlier] - 1
        return float(np.dot(gaps, weights) / total_weight)

    low, high = 0.0, 2.0 * float(durations.max()) + 1.0
    if between(low) <= target_between:
        return (np.arange(sessions) + jitter) * low
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2.0
        if between(middle) > target_between:
            low = middle
        else:
            high = middle
    return (np.arange(sessions) + jitter) * high
