"""The pieces of FlatCake-Ray's tier of vLLM's native offloading (``vllm_tier``) that are not
the tier itself: index lookups off the scheduler thread, what a request tells placement, the
tier's counters in vLLM's offloading stats, and its KV events.

- :class:`IndexLookups`: vLLM's ``AsyncLookupManager`` hands the keys one request looked up
  in a step to a background thread; FlatCake answers them with one prefix lookup in the
  cluster's index (``KVStore.exists``: consecutive pages from the first key, on whichever
  node holds them), keys ordered by their token position.
- :class:`RequestFacts`: the session and turn a request carries in ``kv_transfer_params``
  (``flatcake_session``, ``flatcake_turn``, ``flatcake_prior_reply_tokens``, as the
  connector reads them), kept on vLLM's ``ReqContext`` for the request's stores.
- :class:`TierCounters`: what the tier moved, as ``vllm:flatcake_tier_*`` counters (label
  ``tier``) in vLLM's ``OffloadingConnectorStats``; vLLM's own tiering metrics
  (``vllm:kv_offload_tiering_*``: bytes, times, failures, hits per tier) come from the
  tier's job results.
- :class:`TierEvents`: ``OffloadingEvent`` s vLLM turns into ``BlockStored``/``BlockRemoved``
  KV events: stored blocks with the medium placement chose (CPU: FlatCake DRAM, STORAGE:
  SSD), ownership ``"flatcake"``, and withdrawals of announced blocks a lookup or load found
  gone, as the connector's events (``_vllm_events``) do.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
)
from vllm.v1.kv_offload.base import Medium as VllmMedium
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.gva import Medium
from flatcake_ray.integrations._vllm_events import OWNERSHIP

__all__ = [
    "TIER_FIELDS",
    "IndexLookups",
    "RequestFacts",
    "TierCounters",
    "TierEvents",
    "in_token_order",
]

EVENT_MEDIUM = {Medium.DRAM: VllmMedium.CPU, Medium.SSD: VllmMedium.STORAGE}

TIER_FIELDS: dict[str, str] = {
    "stored_blocks": "Chunks the FlatCake tier stored (cascaded from vLLM's CPU tier).",
    "stored_dram_blocks": "Of those, chunks placed in FlatCake DRAM.",
    "stored_ssd_blocks": "Of those, chunks placed on FlatCake SSD.",
    "skipped_blocks": "Chunks a cascade offered that FlatCake already held (write-once).",
    "failed_stores": "Cascade jobs FlatCake could not store (the chunks stay a miss).",
    "loaded_blocks": "Chunks promoted from FlatCake into vLLM's CPU tier.",
    "failed_load_blocks": "Chunks a promotion could not deliver (recomputed).",
    "lookup_keys": "Chunk lookups answered from FlatCake's index.",
    "lookup_hits": "Of those, chunks found.",
    "withdrawn_blocks": "Announced chunks withdrawn (BlockRemoved) after a miss.",
}


def metric_name(field: str) -> str:
    return f"vllm:flatcake_tier_{field}"


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    return {
        metric_name(field): OffloadingCounterMetadata(documentation=text, labelnames=("tier",))
        for field, text in TIER_FIELDS.items()
    }


def in_token_order(keys: Sequence[OffloadKey], req_context: ReqContext) -> list[int]:
    """Indexes of ``keys`` by the token position vLLM recorded for each (a key it recorded
    none for keeps its place after those it did): FlatCake's lookups and puts are prefixes."""
    unknown = 1 << 62
    positions = [req_context.get_offload_key_position(key) for key in keys]
    return sorted(range(len(keys)), key=lambda i: (positions[i] or unknown, i))


class IndexLookups(AsyncLookupManager):
    """vLLM's async lookup state machine over FlatCake's index: ``batch_lookup`` runs on
    vLLM's lookup thread, one prefix lookup per request per step."""

    def __init__(
        self,
        tier_type: str,
        exists: Callable[[list[OffloadKey]], int],
        counters: TierCounters,
        on_missing: Callable[[list[OffloadKey]], object],
    ) -> None:
        self._exists = exists
        self._counters = counters
        self._on_missing = on_missing
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        order = in_token_order(keys, req_context)
        hits = self._exists([keys[i] for i in order])
        found = [False] * len(keys)
        for i in order[:hits]:
            found[i] = True
        self._counters.add(lookup_keys=len(keys), lookup_hits=hits)
        if hits < len(keys):
            # No prefix reaches past the first missing chunk: announced ones there go too.
            self._on_missing([keys[i] for i in order[hits:]])
        return found


@dataclass(frozen=True)
class RequestFacts:
    """What one request tells placement (read once, in ``on_new_request``)."""

    session_id: str | None = None
    turn: int | None = None
    prior_reply_tokens: int | None = None

    @classmethod
    def of(cls, req_context: ReqContext) -> RequestFacts:
        known = req_context.get_state(cls)
        if known is not None:
            return known
        params = req_context.kv_transfer_params or {}
        session = params.get("flatcake_session")
        facts = cls(
            session_id=None if session is None else str(session),
            turn=params.get("flatcake_turn"),
            prior_reply_tokens=params.get("flatcake_prior_reply_tokens"),
        )
        req_context.set_state(facts)
        return facts

    def hints(self, context_tokens: int | None) -> PutHints:
        return PutHints(
            turn=self.turn,
            prior_reply_tokens=self.prior_reply_tokens,
            context_tokens=context_tokens,
        )


class TierCounters:
    """Running totals, added to from the tier's job threads; ``take`` hands vLLM what moved
    since the last call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[str, int] = dict.fromkeys(TIER_FIELDS, 0)
        self.totals: dict[str, int] = dict.fromkeys(TIER_FIELDS, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for field, delta in deltas.items():
                self._since[field] += delta
                self.totals[field] += delta

    def take(self, tier: str) -> OffloadingConnectorStats | None:
        with self._lock:
            moved = {field: value for field, value in self._since.items() if value}
            self._since = dict.fromkeys(TIER_FIELDS, 0)
        if not moved:
            return None
        stats = OffloadingConnectorStats()
        for field, value in moved.items():
            stats.increase_counter(metric_name(field), value, (tier,))
        return stats


class TierEvents:
    """The tier's KV events, when vLLM publishes them (``enabled``). Bounded memory of what
    was announced: past ``capacity`` the oldest are forgotten, never withdrawn."""

    def __init__(self, enabled: bool, locality: Locality | None, capacity: int = 1 << 16):
        self.enabled = enabled
        self._locality = locality
        self._capacity = capacity
        self._announced: OrderedDict[OffloadKey, VllmMedium] = OrderedDict()
        self._pending: list[OffloadingEvent] = []
        self._lock = threading.Lock()  # stores finish on job threads

    def stored(self, keys: Sequence[OffloadKey], medium: Medium | None) -> None:
        """``keys`` newly stored on ``medium`` (None: every page was already stored)."""
        if not self.enabled or medium is None or not keys:
            return
        event_medium = EVENT_MEDIUM[medium]
        with self._lock:
            for key in keys:
                self._announced[key] = event_medium
                self._announced.move_to_end(key)
            while len(self._announced) > self._capacity:
                self._announced.popitem(last=False)
            self._pending.append(self._event(list(keys), event_medium, removed=False))

    def withdraw(self, keys: Iterable[OffloadKey]) -> int:
        """BlockRemoved for those of ``keys`` this tier announced; how many."""
        if not self.enabled:
            return 0
        gone: dict[VllmMedium, list[OffloadKey]] = {}
        with self._lock:
            for key in keys:
                medium = self._announced.pop(key, None)
                if medium is not None:
                    gone.setdefault(medium, []).append(key)
            for medium, removed in gone.items():
                self._pending.append(self._event(removed, medium, removed=True))
        return sum(len(removed) for removed in gone.values())

    def take(self) -> list[OffloadingEvent]:
        with self._lock:
            taken, self._pending = self._pending, []
        return taken

    def _event(self, keys: list[OffloadKey], medium: VllmMedium, removed: bool) -> Any:
        return OffloadingEvent(
            keys=keys, medium=medium, removed=removed, locality=self._locality, ownership=OWNERSHIP
        )
