"""The parameters of the ``agentic``, ``chat`` and ``mixed`` synthetic profiles.

Token lengths are log-normal (median, sigma). The agentic numbers were calibrated against
the paper's Claude Code row (see :mod:`.synth`); the chat numbers were measured on the
shared Mooncake conversation trace with sessions inferred (:mod:`.infer`): 69% of sessions
have one turn (so a turn continues with p ~0.31), first prompts have a median of 5,264
tokens (p10 905, p90 25,559), replies a median of 350, the user message added per turn a
median of ~25 tokens with a heavy tail, and turns come a median of 123 s apart (mean 215 s)
at 2.08 new sessions per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from flatcake_ray.traces.synth_model import AgentPhase, ChatPhase, LogNormal, SessionClass

PLACEMENTS = ("stagger", "rate", "span")


@dataclass(frozen=True)
class SessionGroup:
    """``full_count`` sessions of one class, and how their start times are placed.

    ``stagger``: spaced so ``requests_between`` other requests fall between consecutive requests
    of a session (see :mod:`.synth_schedule`);
    ``rate``: uniform at ``session_rate_per_s``; ``span``: uniform over the span the
    staggered sessions cover.
    """

    kind: SessionClass
    full_count: int
    prefix: str
    placement: str = "stagger"
    session_rate_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.placement == "rate" and not self.session_rate_per_s > 0:
            raise ValueError("placement 'rate' needs session_rate_per_s > 0")

    def count_at(self, scale: float) -> int:
        # At least one session per group, so a tiny scale still shows every class.
        return max(1, math.floor(self.full_count * scale + 0.5))


@dataclass(frozen=True)
class Profile:
    groups: tuple[SessionGroup, ...]
    block_tokens: int
    qps: float
    requests_between: float = 0.0


AGENT_STEPS = AgentPhase(
    step_gap_s=LogNormal(6.0, 1.4, low=0.2),
    tool_output_tokens=LogNormal(1_700.0, 1.0, high=60_000),
    reply_tokens=LogNormal(250.0, 1.0, high=8_000),
    tail_tokens=LogNormal(260.0, 0.6),
    steps_between_spawns=LogNormal(18.0, 0.3),
    mean_extra_subagents=1.5,
    mean_subagent_turns=10.0,
    subagent_task_tokens=LogNormal(600.0, 0.8),
    subagent_result_tokens=LogNormal(800.0, 0.8),
    compact_at_tokens=460_000,
    summary_tokens=LogNormal(12_000.0, 0.4),
)

AGENTIC_SESSION = SessionClass(
    name="agentic",
    system_tokens=18_000,
    first_prompt_tokens=LogNormal(1_500.0, 1.0),
    agent=AGENT_STEPS,
    agent_steps=LogNormal(110.0, 0.15),
)

CHAT_TURNS = ChatPhase(
    think_gap_s=LogNormal(210.0, 1.06, low=1.0),
    user_tokens=LogNormal(25.0, 2.7, high=60_000),
    reply_tokens=LogNormal(300.0, 0.8, high=2_000),
    tail_tokens=LogNormal(600.0, 1.3, high=100_000),
)

CHAT_SESSION = SessionClass(
    name="chat",
    system_tokens=512,
    first_prompt_tokens=LogNormal(4_800.0, 1.2, low=50, high=128_000),
    chat=CHAT_TURNS,
    chat_continue_probability=0.31,
    chat_continue_growth=0.1,
    chat_continue_cap=0.68,
)

# A chat that turns agentic: a few chat turns, then agent steps in the same context.
SWITCH_SESSION = SessionClass(
    name="switch",
    system_tokens=18_000,
    first_prompt_tokens=LogNormal(300.0, 0.8),
    chat=ChatPhase(
        think_gap_s=LogNormal(60.0, 0.8, low=1.0),
        user_tokens=LogNormal(80.0, 0.8),
        reply_tokens=LogNormal(150.0, 0.6, high=1_000),
    ),
    fixed_chat_turns=(2, 4),
    agent=AGENT_STEPS,
    agent_steps=LogNormal(60.0, 0.5),
)

# Chat sessions of a mixed deployment: chat's shape, their own (longer) system prompt.
MIXED_CHAT_SESSION = SessionClass(
    name="chat",
    system_tokens=2_000,
    first_prompt_tokens=LogNormal(3_000.0, 1.3, low=50, high=128_000),
    chat=CHAT_TURNS,
    chat_continue_probability=0.31,
    chat_continue_growth=0.1,
    chat_continue_cap=0.68,
)

PROFILES: dict[str, Profile] = {
    "agentic": Profile(
        groups=(SessionGroup(AGENTIC_SESSION, 393, "agentic"),),
        block_tokens=64,
        qps=0.5,
        requests_between=0.88,
    ),
    "chat": Profile(
        groups=(
            SessionGroup(CHAT_SESSION, 7_373, "chat", placement="rate", session_rate_per_s=2.08),
        ),
        block_tokens=512,
        qps=3.4,
    ),
    "mixed": Profile(
        groups=(
            SessionGroup(AGENTIC_SESSION, 40, "agentic"),
            SessionGroup(SWITCH_SESSION, 40, "switch"),
            SessionGroup(MIXED_CHAT_SESSION, 2_000, "chat", placement="span"),
        ),
        block_tokens=64,
        qps=1.0,
        requests_between=0.88,
    ),
}


def with_context_scale(profile: Profile, factor: float) -> Profile:
    """``profile`` with every token length (prompts, outputs, tails, thresholds) times
    ``factor``; times and counts stay. Fewer tokens per request make replays cheaper; the
    partial last block of each request does not shrink, so once-access creeps up a little.
    """
    if factor == 1.0:
        return profile
    groups = tuple(
        replace(group, kind=_scaled_class(group.kind, factor)) for group in profile.groups
    )
    return replace(profile, groups=groups)


def _scaled_class(kind: SessionClass, factor: float) -> SessionClass:
    return replace(
        kind,
        system_tokens=max(1, round(kind.system_tokens * factor)),
        first_prompt_tokens=_scaled(kind.first_prompt_tokens, factor),
        chat=None if kind.chat is None else _scaled_chat(kind.chat, factor),
        agent=None if kind.agent is None else _scaled_agent(kind.agent, factor),
    )


def _scaled_chat(chat: ChatPhase, factor: float) -> ChatPhase:
    return replace(
        chat,
        user_tokens=_scaled(chat.user_tokens, factor),
        reply_tokens=_scaled(chat.reply_tokens, factor),
        tail_tokens=None if chat.tail_tokens is None else _scaled(chat.tail_tokens, factor),
    )


def _scaled_agent(agent: AgentPhase, factor: float) -> AgentPhase:
    return replace(
        agent,
        tool_output_tokens=_scaled(agent.tool_output_tokens, factor),
        reply_tokens=_scaled(agent.reply_tokens, factor),
        tail_tokens=_scaled(agent.tail_tokens, factor),
        subagent_task_tokens=_scaled(agent.subagent_task_tokens, factor),
        subagent_result_tokens=_scaled(agent.subagent_result_tokens, factor),
        compact_at_tokens=max(1, round(agent.compact_at_tokens * factor)),
        summary_tokens=_scaled(agent.summary_tokens, factor),
    )


def _scaled(tokens: LogNormal, factor: float) -> LogNormal:
    return replace(
        tokens,
        median=tokens.median * factor,
        low=max(1.0, tokens.low * factor),
        high=tokens.high * factor,
    )
