"""``trace synth``: synthetic traces of agentic, chat and mixed workloads.

Profiles (full size at ``scale=1``; ``scale`` multiplies every session count):

``agentic``
    Claude-Code-like: 393 sessions, 64-token blocks, ~250 requests per session, contexts of
    ~220K tokens that grow by a tool output every step, sub-agents that replay the session
    prefix in parallel, compaction. Calibrated to the paper's Claude Code row (98,827
    requests, 3,421 blocks per request, 16.6% once-access, 98.31% hit rate, reuse distance
    0.85 / P99 14 *intervening* requests; see :mod:`.stats` for why intervening).
``chat``
    Mooncake-conversation-like: 7,373 sessions of mostly one turn, 512-token blocks, one
    shared system-prompt block, minutes between turns: ~75% once-access, reuse distances of
    hundreds of requests, hit rate ~35-40%.
``mixed``
    Both on one clock at 64-token blocks, plus sessions that change class: 2-4 chat turns
    (short messages and replies, minutes apart), then agent steps (long tool outputs, seconds
    apart, sub-agents). Session ids are prefixed ``agentic-``, ``chat-`` and ``switch-``.

How a trace is made. Each session is planned on its own clock (:mod:`.synth_model`) with its
own random stream (seeded by ``(seed, class, session number)``, so a scaled-down trace holds
exactly the first sessions of the full one). Agentic sessions are then staggered so that,
on average, the profile's ``requests_between`` other requests fall between two consecutive
requests of a session (:mod:`.synth_schedule`), solved on the sessions actually planned, so
reuse distances stay on target from ``scale=0.01`` (4 sessions) up; chat sessions start
uniformly at a fixed session rate (mixed: over the agentic sessions' span). Merging all
sessions by time gives the arrival *order*, which is what reuse distance (in requests)
depends on. Arrival *times* are then stamped as a Poisson process at ``qps`` (or, with
``arrivals="model"``, the model's own clock rescaled to ``qps``). Turn = the request's
ordinal within its session (sub-agent requests included).

Block ids are numbered in order of first appearance, so ``0 .. unique-1``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from flatcake_ray.errors import ConfigError
from flatcake_ray.traces.records import TraceRequest
from flatcake_ray.traces.synth_model import ChainTable, PlannedRequests, SessionPlanner
from flatcake_ray.traces.synth_profiles import (
    PROFILES,
    Profile,
    SessionGroup,
    with_context_scale,
)
from flatcake_ray.traces.synth_schedule import stagger_starts

ARRIVAL_MODES = ("poisson", "model")


@dataclass(frozen=True)
class SynthOptions:
    profile: str = "agentic"
    seed: int = 0
    scale: float = 0.01
    qps: float | None = None  # None: the profile's default
    block_tokens: int | None = None  # None: the profile's default
    arrivals: str = "poisson"
    context_scale: float = 1.0  # multiplies every token length (see with_context_scale)

    def validate(self) -> Profile:
        if self.profile not in PROFILES:
            raise ConfigError(f"unknown profile {self.profile!r}; known: {', '.join(PROFILES)}")
        if not self.scale > 0:
            raise ConfigError(f"scale must be > 0, got {self.scale}")
        if self.qps is not None and not self.qps > 0:
            raise ConfigError(f"qps must be > 0, got {self.qps}")
        if self.block_tokens is not None and self.block_tokens < 1:
            raise ConfigError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if not self.context_scale > 0:
            raise ConfigError(f"context_scale must be > 0, got {self.context_scale}")
        if self.arrivals not in ARRIVAL_MODES:
            raise ConfigError(f"arrivals must be one of {ARRIVAL_MODES}, got {self.arrivals!r}")
        return with_context_scale(PROFILES[self.profile], self.context_scale)


class SyntheticTrace:
    """A planned synthetic trace; iterate it to stream :class:`TraceRequest` in order."""

    def __init__(self, options: SynthOptions) -> None:
        profile = options.validate()
        self.options = options
        self.block_tokens = options.block_tokens or profile.block_tokens
        self.qps = options.qps or profile.qps
        self.chains = ChainTable()
        self.planned = PlannedRequests()
        self.session_names: list[str] = []
        self._session_starts: list[float] = []
        self._plan(profile)
        self.order = self._arrival_order()
        self.arrival_s = self._arrival_times()
        self.turns = self._turns()

    def __len__(self) -> int:
        return len(self.planned)

    @property
    def sessions(self) -> int:
        return len(self.session_names)

    @property
    def total_block_ids(self) -> int:
        """Block ids the trace will hold (sum over requests), known before materialising."""
        tokens = np.asarray(self.planned.context_tokens) + np.asarray(self.planned.tail_tokens)
        return int((-(-tokens // self.block_tokens)).sum())

    def _plan(self, profile: Profile) -> None:
        staggered: list[tuple[int, float, int]] = []  # (session, duration, requests)
        spread_later: list[tuple[SessionGroup, list[int]]] = []
        for group_no, group in enumerate(profile.groups):
            system_chain = self.chains.new(-1, 0)
            self.chains.use(system_chain, group.kind.system_tokens)
            members = [
                self._plan_session(group, group_no, number, system_chain)
                for number in range(group.count_at(self.options.scale))
            ]
            if group.placement == "stagger":
                staggered.extend(members)
            else:
                spread_later.append((group, [session for session, _, _ in members]))
        self._session_starts = [0.0] * len(self.session_names)
        span = self._stagger(staggered, profile.requests_between)
        for group, sessions in spread_later:
            width = span if group.placement == "span" else len(sessions) / group.session_rate_per_s
            self._spread(sessions, width)

    def _plan_session(
        self, group: SessionGroup, group_no: int, number: int, system_chain: int
    ) -> tuple[int, float, int]:
        session = len(self.session_names)
        self.session_names.append(f"{group.prefix}-{number}")
        rng = np.random.default_rng([self.options.seed, group_no, number])
        before = len(self.planned)
        planner = SessionPlanner(self.chains, self.planned, system_chain, group.kind, session, rng)
        duration = planner.plan()
        return session, duration, len(self.planned) - before

    def _stagger(self, members: list[tuple[int, float, int]], target_between: float) -> float:
        """Start the staggered sessions (see :mod:`.synth_schedule`); returns their span."""
        if not members:
            return 0.0
        rng = np.random.default_rng([self.options.seed, 1 << 20])
        shuffled = [members[i][0] for i in rng.permutation(len(members))]
        slot_of = np.full(len(self.session_names), -1, dtype=np.int64)
        slot_of[shuffled] = np.arange(len(shuffled))
        request_slot = slot_of[np.asarray(self.planned.session, dtype=np.int64)]
        mine = request_slot >= 0
        durations = np.zeros(len(shuffled))
        for session, duration, _ in members:
            durations[slot_of[session]] = duration
        starts = stagger_starts(
            request_slot[mine],
            np.asarray(self.planned.time_s)[mine],
            np.asarray(self.planned.context_tokens)[mine],
            durations,
            target_between,
            rng.random(len(shuffled)),
        )
        for slot, session in enumerate(shuffled):
            self._session_starts[session] = float(starts[slot])
        return float((starts + durations).max())

    def _spread(self, sessions: list[int], width: float) -> None:
        """Start ``sessions`` uniformly over ``[0, width)``, one per equal slot."""
        rng = np.random.default_rng([self.options.seed, 1 << 21, len(sessions)])
        # Stratified rather than Poisson, so small scales keep an even load.
        slot = width / max(len(sessions), 1)
        starts = (np.arange(len(sessions)) + rng.random(len(sessions))) * slot
        for session, start in zip(sessions, starts.tolist(), strict=True):
            self._session_starts[session] = start

    def _arrival_order(self) -> np.ndarray:
        planned = self.planned
        starts = np.asarray(self._session_starts)[np.asarray(planned.session, dtype=np.int64)]
        absolute = starts + np.asarray(planned.time_s)
        self._model_time = absolute
        return np.argsort(absolute, kind="stable")

    def _arrival_times(self) -> np.ndarray:
        count = len(self.planned)
        if count == 0:
            return np.zeros(0)
        if self.options.arrivals == "model":
            model = self._model_time[self.order]
            model = model - model[0]
            span = model[-1]
            target = (count - 1) / self.qps
            return model * (target / span) if span > 0 else model
        rng = np.random.default_rng([self.options.seed, 1 << 22])
        gaps = rng.exponential(1.0 / self.qps, count)
        gaps[0] = 0.0
        return np.cumsum(gaps)

    def _turns(self) -> np.ndarray:
        sessions = np.asarray(self.planned.session, dtype=np.int64)[self.order]
        turns = np.empty(sessions.size, dtype=np.int64)
        seen = np.zeros(self.sessions, dtype=np.int64)
        for position, session in enumerate(sessions.tolist()):
            seen[session] += 1
            turns[position] = seen[session]
        return turns

    def __iter__(self) -> Iterator[TraceRequest]:
        return _BlockMaterializer(self).requests()


class _BlockMaterializer:
    """Turns planned token ranges into block ids, numbered by first appearance."""

    def __init__(self, trace: SyntheticTrace) -> None:
        self.trace = trace
        chains, bt = trace.chains, trace.block_tokens
        self.own_start = np.asarray(chains.fork_tokens, dtype=np.int64) // bt
        own_end = np.maximum(np.asarray(chains.used_tokens, dtype=np.int64) // bt, self.own_start)
        sizes = own_end - self.own_start
        self.base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.next_raw = int(sizes.sum())
        self.next_id = 0
        self.remap = np.full(self.next_raw + 1024, -1, dtype=np.int64)

    def requests(self) -> Iterator[TraceRequest]:
        trace, planned, bt = self.trace, self.trace.planned, self.trace.block_tokens
        for position, index in enumerate(trace.order.tolist()):
            context = planned.context_tokens[index]
            tail = planned.tail_tokens[index]
            raw = self._raw_ids(planned.chain[index], context, tail)
            blocks = self._renumbered(raw)
            blocks.flags.writeable = False
            yield TraceRequest(
                arrival_s=float(trace.arrival_s[position]),
                session=trace.session_names[planned.session[index]],
                turn=int(trace.turns[position]),
                blocks=blocks,
                input_tokens=context + tail,
                output_tokens=planned.output_tokens[index],
                block_tokens=bt,
            )

    def _raw_ids(self, chain: int, context: int, tail: int) -> np.ndarray:
        bt = self.trace.block_tokens
        full = context // bt
        pieces = []
        parents, remaining = self.trace.chains.parent, full
        while chain >= 0 and remaining > 0:
            own_start = int(self.own_start[chain])
            if remaining > own_start:
                start = int(self.base[chain])
                pieces.append(np.arange(start, start + remaining - own_start, dtype=np.int64))
                remaining = own_start
            chain = parents[chain]
        pieces.reverse()
        tail_blocks = math.ceil((context + tail) / bt) - full
        if tail_blocks:
            pieces.append(np.arange(self.next_raw, self.next_raw + tail_blocks, dtype=np.int64))
            self.next_raw += tail_blocks
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    def _renumbered(self, raw: np.ndarray) -> np.ndarray:
        if raw.size and int(raw.max()) >= self.remap.size:
            grown = np.full(max(2 * self.remap.size, int(raw.max()) + 1), -1, dtype=np.int64)
            grown[: self.remap.size] = self.remap
            self.remap = grown
        ids = self.remap[raw]
        new = ids < 0
        if new.any():
            fresh = np.arange(self.next_id, self.next_id + int(new.sum()), dtype=np.int64)
            self.remap[raw[new]] = fresh
            ids[new] = fresh
            self.next_id += fresh.size
        return ids
