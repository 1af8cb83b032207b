"""The session model behind ``trace synth``: token-level chains and per-session plans.

Everything is modelled in tokens and turned into blocks only at the end, so one model
serves any block size. A *chain* is an append-only token history: the global system prompt
of a session class, a session's main context, a sub-agent's context (which starts from a
copy of its parent's context: it replays the session prefix), or a context restarted by
compaction. A request reads a chain's first ``context_tokens`` tokens plus ``tail_tokens``
of its own that no later request repeats (the changing end of a prompt: reminders, the
latest instruction), then the chain grows by the reply and the next tool output or user
message. Block ids follow from that: the full blocks of a chain prefix are shared by every
request that reads them; a request's partial last block and its tail are new ids.

A session is planned on its own virtual clock (seconds from its start); :mod:`.synth`
places sessions on a common clock, merges them into one arrival order and stamps arrivals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class LogNormal:
    """A log-normal draw given by its median, clipped to ``[low, high]``."""

    median: float
    sigma: float
    low: float = 1.0
    high: float = math.inf

    def draw(self, rng: np.random.Generator) -> float:
        value = self.median * math.exp(self.sigma * rng.standard_normal())
        return min(max(value, self.low), self.high)

    def rounded(self, rng: np.random.Generator) -> int:
        return round(self.draw(rng))


@dataclass(frozen=True)
class ChatPhase:
    """Chat turns: a user message, a short reply, minutes of user think time.

    ``tail_tokens`` is per-request content the next turn does not carry (retrieved passages,
    an attachment): on the Mooncake trace a continuing turn brings ~6.8 new blocks of which
    ~5.9 are never read again, so this is most of what makes chat blocks one-shot.
    """

    think_gap_s: LogNormal
    user_tokens: LogNormal
    reply_tokens: LogNormal
    tail_tokens: LogNormal | None = None


@dataclass(frozen=True)
class AgentPhase:
    """Agent steps: tool output appended every step, sub-agents, compaction."""

    step_gap_s: LogNormal
    tool_output_tokens: LogNormal
    reply_tokens: LogNormal
    tail_tokens: LogNormal
    steps_between_spawns: LogNormal  # main steps from one sub-agent spawn to the next
    mean_extra_subagents: float  # a spawn starts 1 + Poisson(mean this) sub-agents
    mean_subagent_turns: float  # each runs 1 + Poisson(mean this - 1) requests
    subagent_task_tokens: LogNormal
    subagent_result_tokens: LogNormal
    compact_at_tokens: int
    summary_tokens: LogNormal


@dataclass(frozen=True)
class SessionClass:
    """One kind of session: how it starts, how many chat turns and agent steps it has."""

    name: str
    system_tokens: int
    first_prompt_tokens: LogNormal
    chat: ChatPhase | None = None
    # After chat turn k a session goes on with probability
    # min(chat_continue_cap, chat_continue_probability + chat_continue_growth * (k - 1)):
    # people who have replied a few times tend to go on (Mooncake: 0.31, 0.42, 0.51, 0.59 ...).
    chat_continue_probability: float = 0.0
    chat_continue_growth: float = 0.0
    chat_continue_cap: float = 0.0
    fixed_chat_turns: tuple[int, int] | None = None  # uniform range instead, when set
    agent: AgentPhase | None = None
    agent_steps: LogNormal | None = None


@dataclass
class ChainTable:
    """Every chain of a trace: its parent and the token count it inherited at the fork."""

    parent: list[int] = field(default_factory=list)
    fork_tokens: list[int] = field(default_factory=list)
    # Largest token count any request read or any child inherited: sizes its block range.
    used_tokens: list[int] = field(default_factory=list)

    def new(self, parent: int, fork_tokens: int) -> int:
        self.parent.append(parent)
        self.fork_tokens.append(fork_tokens)
        self.used_tokens.append(fork_tokens)
        if parent >= 0:
            self.used_tokens[parent] = max(self.used_tokens[parent], fork_tokens)
        return len(self.parent) - 1

    def use(self, chain: int, tokens: int) -> None:
        self.used_tokens[chain] = max(self.used_tokens[chain], tokens)


@dataclass
class PlannedRequests:
    """Column lists of planned requests (one entry per request)."""

    time_s: list[float] = field(default_factory=list)
    session: list[int] = field(default_factory=list)
    chain: list[int] = field(default_factory=list)
    context_tokens: list[int] = field(default_factory=list)
    tail_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.time_s)


class SessionPlanner:
    """Plans one session's requests into shared :class:`ChainTable`/:class:`PlannedRequests`."""

    def __init__(
        self,
        chains: ChainTable,
        out: PlannedRequests,
        system_chain: int,
        kind: SessionClass,
        session: int,
        rng: np.random.Generator,
    ) -> None:
        self.chains, self.out, self.kind = chains, out, kind
        self.system_chain, self.session, self.rng = system_chain, session, rng
        self.chain = chains.new(system_chain, kind.system_tokens)
        self.tokens = kind.system_tokens + kind.first_prompt_tokens.rounded(rng)
        self.clock = 0.0
        self.steps_to_spawn = self._next_spawn_gap()

    def _next_spawn_gap(self) -> int:
        agent = self.kind.agent
        # Spawns come at fairly regular step intervals, not by a coin per step: a coin
        # makes the sub-agent count per session (and so its request count) vary widely.
        return 0 if agent is None else max(1, agent.steps_between_spawns.rounded(self.rng))

    def plan(self) -> float:
        """Plan the whole session; returns its duration on its own clock."""
        for _ in range(self._chat_turns()):
            self._chat_turn()
        if self.kind.agent is not None and self.kind.agent_steps is not None:
            for _ in range(max(1, self.kind.agent_steps.rounded(self.rng))):
                self._agent_step(self.kind.agent)
        return self.clock

    def _chat_turns(self) -> int:
        kind = self.kind
        if kind.chat is None:
            return 0
        if kind.fixed_chat_turns is not None:
            low, high = kind.fixed_chat_turns
            return int(self.rng.integers(low, high + 1))
        turns = 1
        while True:
            chance = kind.chat_continue_probability + kind.chat_continue_growth * (turns - 1)
            if self.rng.random() >= min(chance, kind.chat_continue_cap):
                return turns
            turns += 1

    def _emit(self, chain: int, context: int, tail: int, output: int, at: float) -> None:
        self.chains.use(chain, context)
        out = self.out
        out.time_s.append(at)
        out.session.append(self.session)
        out.chain.append(chain)
        out.context_tokens.append(context)
        out.tail_tokens.append(tail)
        out.output_tokens.append(output)

    def _chat_turn(self) -> None:
        chat = self.kind.chat
        assert chat is not None
        reply = chat.reply_tokens.rounded(self.rng)
        tail = 0 if chat.tail_tokens is None else chat.tail_tokens.rounded(self.rng)
        self._emit(self.chain, self.tokens, tail, reply, self.clock)
        self.tokens += reply + chat.user_tokens.rounded(self.rng)
        self.clock += chat.think_gap_s.draw(self.rng)

    def _agent_step(self, agent: AgentPhase) -> None:
        rng = self.rng
        reply = agent.reply_tokens.rounded(rng)
        self._emit(self.chain, self.tokens, agent.tail_tokens.rounded(rng), reply, self.clock)
        self.tokens += reply + agent.tool_output_tokens.rounded(rng)
        self.clock += agent.step_gap_s.draw(rng)
        self.steps_to_spawn -= 1
        if self.steps_to_spawn == 0:
            self._spawn(agent)
            self.steps_to_spawn = self._next_spawn_gap()
        if self.tokens >= agent.compact_at_tokens:
            self._compact(agent)

    def _spawn(self, agent: AgentPhase) -> None:
        rng = self.rng
        count = 1 + _extra_count(rng, agent.mean_extra_subagents)
        finished = self.clock
        for _ in range(count):
            finished = max(finished, self._subagent(agent))
        self.clock = finished + agent.step_gap_s.draw(rng)
        # The parent's next step reads every sub-agent's report.
        self.tokens += sum(agent.subagent_result_tokens.rounded(rng) for _ in range(count))

    def _subagent(self, agent: AgentPhase) -> float:
        rng = self.rng
        chain = self.chains.new(self.chain, self.tokens)
        tokens = self.tokens + agent.subagent_task_tokens.rounded(rng)
        clock = self.clock + agent.step_gap_s.draw(rng) * rng.random()
        turns = 1 + _extra_count(rng, agent.mean_subagent_turns - 1.0)
        for _ in range(turns):
            reply = agent.reply_tokens.rounded(rng)
            self._emit(chain, tokens, agent.tail_tokens.rounded(rng), reply, clock)
            tokens += reply + agent.tool_output_tokens.rounded(rng)
            clock += agent.step_gap_s.draw(rng)
        return clock

    def _compact(self, agent: AgentPhase) -> None:
        # The compaction request reads the whole old context; the session then restarts
        # from the system prompt plus the summary, in a new chain.
        rng = self.rng
        summary = agent.summary_tokens.rounded(rng)
        self._emit(self.chain, self.tokens, agent.tail_tokens.rounded(rng), summary, self.clock)
        self.clock += agent.step_gap_s.draw(rng)
        self.chain = self.chains.new(self.system_chain, self.kind.system_tokens)
        self.tokens = self.kind.system_tokens + summary


def _extra_count(rng: np.random.Generator, mean: float) -> int:
    """A count >= 0 with the given mean.

    Poisson rather than geometric: heavy-tailed fan-outs make the few sessions of a
    scaled-down trace differ so much that its statistics drift from the full trace's.
    """
    if mean <= 0.0:
        return 0
    return int(rng.poisson(mean))
