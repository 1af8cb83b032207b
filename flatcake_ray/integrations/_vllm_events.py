"""KV events of the vLLM connector: the blocks FlatCake holds, told to KV-event-driven routers.

With ``kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", ...}`` vLLM
publishes its prefix cache's ``BlockStored``/``BlockRemoved`` events, and with them whatever
its connector's ``take_events`` yields. FlatCake's connector adds:

- ``BlockStored`` for every save that committed (the blocks are in FlatCake from then on):
  vLLM's block hashes (the store's keys), the parent hash, the blocks' token ids, block size,
  LoRA, extra keys and session, as vLLM's own events carry them, ``medium`` ``CPU`` (FlatCake
  DRAM) or ``STORAGE`` (FlatCake SSD; ``None`` when every page was already stored),
  ``ownership`` ``"flatcake"`` and ``group_idx`` 0 (the connector takes one KV cache group).
- ``BlockRemoved`` for announced blocks that a lookup then found gone (reclaimed, lost with a
  node): FlatCake tells no engine when it reclaims, so a withdrawal follows the first lookup
  that misses them. Blocks beyond the first missing one go too: no prefix can reach them.

The path through vLLM: the scheduler side plans each save with an :class:`Announcement`
(the worker has no token ids); the worker, once the save committed, returns the event from
``get_kv_connector_kv_cache_events`` in a :class:`FlatCakeKVEvents`; vLLM's executor merges
the workers' (``add_events``, ``increment_workers``), the scheduler hands the result to
``update_connector_output`` and publishes what ``take_events`` yields that step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import (
    ExternalBlockHash,
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from flatcake_ray.core.gva import Medium

__all__ = [
    "OWNERSHIP",
    "Announced",
    "Announcement",
    "FlatCakeKVEvents",
    "SchedulerEvents",
    "announce",
    "worker_events",
]

OWNERSHIP = "flatcake"
GROUP = 0  # the connector takes exactly one KV cache group
EVENT_MEDIUM = {Medium.DRAM: MEDIUM_CPU, Medium.SSD: MEDIUM_STORAGE}
_SLOWEST_FIRST = (MEDIUM_STORAGE, MEDIUM_CPU)


@dataclass(frozen=True)
class Announcement:
    """The ``BlockStored`` of one planned save, but its medium (known once it committed)."""

    block_hashes: tuple[ExternalBlockHash, ...]
    parent_block_hash: ExternalBlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: tuple[tuple[Any, ...] | None, ...]
    session_id: str | None

    def tail(self, lead: int) -> Announcement:
        """The same save without its first ``lead`` blocks (another save holds them)."""
        return replace(
            self,
            block_hashes=self.block_hashes[lead:],
            parent_block_hash=self.block_hashes[lead - 1],
            token_ids=self.token_ids[lead * self.block_size :],
            extra_keys=self.extra_keys[lead:],
        )

    def stored(self, medium: Medium | None) -> BlockStored:
        return BlockStored(
            block_hashes=list(self.block_hashes),
            parent_block_hash=self.parent_block_hash,
            token_ids=list(self.token_ids),
            block_size=self.block_size,
            lora_id=self.lora_id,
            medium=None if medium is None else EVENT_MEDIUM[medium],
            lora_name=self.lora_name,
            extra_keys=to_event_extra_keys(self.extra_keys),
            group_idx=GROUP,
            ownership=OWNERSHIP,
            session_id=self.session_id,
        )


def announce(
    request: Any, keys: Sequence[bytes], parent: bytes | None, first: int, block_size: int
) -> Announcement:
    """The announcement of blocks ``first, first + 1, ...`` of ``request``, stored under
    ``keys``; vLLM's own events describe a block with the same fields."""
    last = first + len(keys)
    lora = request.lora_request
    return Announcement(
        block_hashes=tuple(maybe_convert_block_hash(key) for key in keys),
        parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
        token_ids=tuple(request.all_token_ids[first * block_size : last * block_size]),
        block_size=block_size,
        lora_id=lora.adapter_id if lora else None,
        lora_name=lora.name if lora else None,
        extra_keys=tuple(
            generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, 0)[0]
            for i in range(first, last)
        ),
        session_id=getattr(request, "session_id", None),
    )


class FlatCakeKVEvents(KVConnectorKVEvents):
    """One step's events of the engine's workers. Every tensor-parallel rank saves its own
    shard, and a block is in FlatCake only once every shard is: :meth:`aggregate` keeps the
    events all workers reported. Shards may land on different media; the merged event names
    the slowest (a load of the block waits for it)."""

    def __init__(self, num_workers: int = 1) -> None:
        self._events: list[KVCacheEvent] = []
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()

    def aggregate(self) -> FlatCakeKVEvents:
        media: dict[KVCacheEvent, list[str | None]] = {}
        for event in self._events:
            media.setdefault(msgspec.structs.replace(event, medium=None), []).append(
                getattr(event, "medium", None)
            )
        self._events = [
            msgspec.structs.replace(event, medium=_slowest(found))
            for event, found in media.items()
            if len(found) >= self._workers
        ]
        self._workers = 1  # what is left is one engine's view
        return self

    def __repr__(self) -> str:
        return f"<FlatCakeKVEvents workers={self._workers} events={len(self._events)}>"


def _slowest(media: Iterable[str | None]) -> str | None:
    found = set(media)
    return next((medium for medium in _SLOWEST_FIRST if medium in found), None)


class Announced:
    """The blocks this engine announced and has not withdrawn, newest last. Bounded: past
    ``capacity`` the oldest are forgotten (never withdrawn; a router ages them out)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._media: OrderedDict[ExternalBlockHash, str | None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._media)

    def note(self, events: Iterable[KVCacheEvent]) -> int:
        """Remember the blocks of ``events``' BlockStored; returns how many blocks they hold."""
        blocks = 0
        for event in events:
            if not isinstance(event, BlockStored):
                continue
            blocks += len(event.block_hashes)
            for block_hash in event.block_hashes:
                self._media[block_hash] = event.medium
                self._media.move_to_end(block_hash)
        while len(self._media) > self.capacity:
            self._media.popitem(last=False)
        return blocks

    def withdraw(self, keys: Sequence[bytes]) -> list[BlockRemoved]:
        """BlockRemoved for those of ``keys`` this engine announced (one event per medium)."""
        gone: dict[str | None, list[ExternalBlockHash]] = {}
        for key in keys:
            block_hash = maybe_convert_block_hash(key)
            if block_hash in self._media:
                gone.setdefault(self._media.pop(block_hash), []).append(block_hash)
        return [
            BlockRemoved(block_hashes=hashes, medium=medium, group_idx=GROUP, ownership=OWNERSHIP)
            for medium, hashes in gone.items()
        ]


def worker_events(
    committed: Sequence[tuple[Announcement, Medium | None]], planned: bool
) -> FlatCakeKVEvents | None:
    """A worker's events for one step: BlockStored for its committed saves. A writer that
    planned saves reports even when none committed, so the merge keeps only blocks every
    shard saved; a step without announced saves reports nothing."""
    if not (planned or committed):
        return None
    events = FlatCakeKVEvents()
    events.add_events([announcement.stored(medium) for announcement, medium in committed])
    return events


class SchedulerEvents:
    """The scheduler side's part: the workers' merged events as they arrive, the withdrawals
    lookups find, and what was announced (to withdraw it, and to count it)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.announced = Announced(capacity)
        self.blocks = {"announced_blocks": 0, "withdrawn_blocks": 0}
        self._arrived: list[FlatCakeKVEvents] = []
        self._withdrawn: list[BlockRemoved] = []

    def arrive(self, events: object) -> None:
        """``KVConnectorOutput.kv_cache_events`` of a step (another connector's are not ours)."""
        if isinstance(events, FlatCakeKVEvents):
            self._arrived.append(events)

    def withdraw(self, keys: Sequence[bytes]) -> None:
        removed = self.announced.withdraw(keys)
        self.blocks["withdrawn_blocks"] += sum(len(event.block_hashes) for event in removed)
        self._withdrawn.extend(removed)

    def take(self) -> list[KVCacheEvent]:
        """This step's events: withdrawals first (found while scheduling, before the step's
        saves, which may store the same blocks again), then what every shard saved."""
        stored = [event for batch in self._arrived for event in batch.aggregate().get_all_events()]
        self._arrived.clear()
        withdrawn, self._withdrawn = self._withdrawn, []
        self.blocks["announced_blocks"] += self.announced.note(stored)
        return [*withdrawn, *stored]
