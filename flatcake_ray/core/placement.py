"""Write-time placement (FC-GVA, paper Table 2) and DRAM read replicas, as a pure policy.

Table 2 picks each put's *home* medium. Rules, first match wins:

1. ``agentic``: context >= L_agent tokens, or prior reply >= tau tokens -> SSD. This comes
   first because a DRAM scope is only worth it for a small footprint: a sub-agent that forks a
   200K-token session shares its prefix (refcount > 1) yet would flood DRAM.
2. ``shared``: the engine says the pages being written are shared (radix-tree refcount > 1)
   -> DRAM. The store also infers forks (a page continued by more than one distinct
   continuation has refcount > 1, counted as ``forks``), but that refcount is the stored
   page's: the fork's own new pages are a new session and are placed by rules 1, 3-5.
3. ``short-chat``: turn > 1 and prior reply < tau -> DRAM.
4. ``one-shot``: a first turn -> SSD; most first turns are never read again.
5. ``unknown-reply``: a later turn whose prior reply length is unknown and may be long -> SSD
   (on flat storage a misplaced block costs SSD bandwidth on a hit, never a miss).

``spill``: a DRAM choice for which DRAM has no room (after reclamation) goes to SSD.

How DRAM is used beyond Table 2 (``PlacementConfig.dram_policy``; measured side by side in
``docs/placement.md``):

- ``replica`` (default): a put homed on SSD is written there as Table 2 says *and* keeps a
  DRAM read replica while DRAM has room. The replica is a copy made at write time (the
  bytes pass through host memory on their way to the drive anyway), never a migration:
  readers prefer it, and it is dropped, whole per session and without any write-back, when
  DRAM is needed by a home (Table 2) scope or by a more recently used session's replicas.
  So the SSD layout, FC-MAS and the hit rate of flat storage stay exactly what they were,
  and DRAM that Table 2 leaves empty serves hits at DRAM speed.
- ``table2``: the paper's rules only (agentic scopes on SSD even when DRAM is empty).
- ``admit``: a later turn that Table 2 sends to SSD is homed on DRAM instead (no SSD copy)
  while that keeps DRAM under its low watermark: the admission-by-reuse alternative. Its
  pages are lost when the scope is reclaimed, so it trades hits for SSD bandwidth.

Blocks never migrate. When a session changes class between turns (a short chat that turns
agentic), its earlier blocks stay where they are and the new turn's blocks go to the session's
scope on the new medium; each session keeps at most one scope per medium (plus one replica
scope), so its history stays grouped per medium, and a restore reads the DRAM part by memcpy
and the SSD part as coalesced sequential reads. Going back (agentic to short chat) does not
happen by rule 1 because the context only grows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from flatcake_ray.config import PlacementConfig
from flatcake_ray.core.gva import Medium


@dataclass(frozen=True)
class PlacementInputs:
    """What the store knows about a put when it places it."""

    prefix_refcount: int  # distinct continuations of the page this put continues (1 = none other)
    turn: int  # 1 for a session's first put
    prior_reply_tokens: int | None  # None: unknown
    context_tokens: int  # tokens of the whole prefix after this put


@dataclass(frozen=True)
class Placement:
    medium: Medium
    rule: str  # agentic | shared | short-chat | one-shot | unknown-reply | spill | admitted


class PlacementRule(Protocol):
    """What the catalog asks of a placement: :class:`PlacementPolicy`, or a stand-in (the
    replay model's oracle)."""

    def decide(self, inputs: PlacementInputs, *, dram_headroom: bool = ...) -> Placement: ...

    def replicate(self, home: Placement) -> bool: ...

    def infer_prior_reply(self, turn: int, appended_tokens: int) -> int | None: ...


@dataclass(frozen=True)
class PlacementPolicy:
    config: PlacementConfig = field(default_factory=PlacementConfig)

    def decide(
        self, inputs: PlacementInputs, dram_has_room: bool = True, dram_headroom: bool = False
    ) -> Placement:
        """The home medium. ``dram_has_room``: a DRAM home fits (after reclamation);
        ``dram_headroom``: it fits under the low watermark without reclaiming anything."""
        choice = self._by_scope(inputs)
        if choice.medium is Medium.DRAM and not dram_has_room:
            return Placement(Medium.SSD, "spill")
        if self._admits(choice, inputs) and dram_headroom:
            return Placement(Medium.DRAM, "admitted")
        return choice

    def replicate(self, home: Placement) -> bool:
        """Whether a put homed on ``home`` also asks for a DRAM read replica (the catalog
        grants it only from DRAM that no home scope needs)."""
        return self.config.dram_policy == "replica" and home.medium is Medium.SSD

    def _admits(self, choice: Placement, inputs: PlacementInputs) -> bool:
        return (
            self.config.dram_policy == "admit"
            and choice.medium is Medium.SSD
            and choice.rule != "spill"
            and inputs.turn > 1  # a continuing session: reuse is likely and near
        )

    def _by_scope(self, inputs: PlacementInputs) -> Placement:
        tau = self.config.tau_tokens
        reply = inputs.prior_reply_tokens
        if inputs.context_tokens >= self.config.l_agent_tokens or (
            reply is not None and reply >= tau
        ):
            return Placement(Medium.SSD, "agentic")
        if inputs.prefix_refcount > 1:
            return Placement(Medium.DRAM, "shared")
        if inputs.turn > 1 and reply is not None and reply < tau:
            return Placement(Medium.DRAM, "short-chat")
        return Placement(Medium.SSD, "one-shot" if inputs.turn <= 1 else "unknown-reply")

    def infer_prior_reply(self, turn: int, appended_tokens: int) -> int | None:
        """A bound on the prior reply when the engine did not say.

        A next turn appends the prior reply plus the new prompt, so the reply is at most the
        appended tokens: below tau that proves a short reply; otherwise it is unknown and
        rule 3 does not fire (the turn stays on SSD, where a misprediction costs bandwidth,
        not a miss).
        """
        if turn <= 1:
            return None
        return appended_tokens if appended_tokens < self.config.tau_tokens else None
