"""Scheduler side of the vLLM connector: which blocks to load, which to save, per step.

The scheduler process holds no KV. It asks the store how much of a request's prefix it has
(``get_num_new_matched_tokens``), remembers where vLLM put the blocks to fill
(``update_state_after_alloc``), and each step tells the workers what to load and which newly
full blocks to save (``build_connector_meta``). Keys are vLLM's own block hashes: chained
prefix hashes, so one key names one whole prefix and the same prefix maps to the same key in
every engine that shares the hash seed.

Shared-prefix holds (``core/prefix_holds.py`` states the rule; the replay model runs the same
class). Two turns of one session often wait together; vLLM caches a block in HBM only once a
request has loaded or computed it, so without a hold both would read the session's prefix
from SSD. A request that would read from SSD blocks an older request is bringing into HBM
gets ``None`` ("ask again later") from the lookup until that request's prefill is scheduled
to its end (its blocks are then in vLLM's prefix cache) or it finishes; the next lookup
finds the prefix in HBM and loads only the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from flatcake_ray.core.api import KVStore, Probe
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.prefix_holds import PrefixHolds
from flatcake_ray.errors import ConfigError

LOAD_POLICIES = ("auto", "always", "never")
# ``auto`` reads an SSD hit of at most this many bytes (one worker's share) inside the step:
# about a millisecond of a drive's reads, less than the engine step an asynchronous load adds
# to the request's TTFT (on this VM 1-1.5 ms; on a GPU, one step of the running batch).
IN_STEP_SSD_BYTES = 4 << 20


@dataclass(frozen=True)
class LoadSpec:
    """Restore ``keys`` into vLLM blocks ``block_ids`` (same order) for one request."""

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    tenant: str  # namespace suffix; each worker prepends its own shard's namespace
    is_async: bool
    # (namespace, lease grant) per shard whose lookup leased exactly ``keys`` (a store whose
    # lookups are calls, ``KVStore.probe``): that shard's worker restores under it, no call.
    grants: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class SaveSpec:
    """Save vLLM blocks ``block_ids`` under ``keys``; ``parent`` is the key they continue."""

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    tenant: str
    parent: bytes | None
    session_id: str | None
    hints: PutHints
    announce: Any = None  # _vllm_events.Announcement, when the engine publishes KV events


@dataclass
class _Tracked:
    request: Any  # vllm.v1.request.Request: its block_hashes grow as tokens arrive
    tenant: str
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # blocks [0, saved_blocks) are in the store or already saved
    offer: LoadSpec | None = None  # the hit last reported, until vLLM allocates for it
    hit_on_ssd: bool = False


@dataclass(frozen=True)
class StepPlan:
    loads: tuple[LoadSpec, ...]
    saves: tuple[SaveSpec, ...]
    # No tokens scheduled: the engine only polls its transfers this step (and, idle, would
    # poll again at once), so a worker may block on its async loads instead of spinning.
    idle: bool = False


class SchedulerSide:
    """State that lives in vLLM's scheduler process, one instance per engine."""

    def __init__(
        self,
        store: KVStore,
        *,
        block_size: int,
        hash_block_size: int,
        shard_namespaces: tuple[str, ...],
        load_policy: str = "auto",
        lease_in_lookup: bool = True,
        block_bytes: int = 0,
        in_step_ssd_bytes: int = IN_STEP_SSD_BYTES,
        announcer: Callable[[Any, Sequence[bytes], bytes | None, int], Any] | None = None,
        on_missing: Callable[[Sequence[bytes]], None] | None = None,
        hold_shared_prefixes: bool = True,
    ) -> None:
        """``announcer(request, keys, parent, first_block)`` describes a planned save for the
        KV events; ``on_missing(keys)`` hears of keys a lookup found gone (both optional).
        ``lease_in_lookup``: a hit's lookup leases it for the one worker that loads each
        shard (where a store hands out grants). ``block_bytes``: one worker's bytes of a vLLM
        block, all layers (what a hit of one block reads); with ``load_policy`` auto an SSD
        hit of at most ``in_step_ssd_bytes`` loads inside the step."""
        if block_size % hash_block_size:
            raise ConfigError(
                f"block size {block_size} is not a multiple of the hash block {hash_block_size}"
            )
        if load_policy not in LOAD_POLICIES:
            raise ConfigError(f"load_async must be one of {LOAD_POLICIES}, not {load_policy!r}")
        if in_step_ssd_bytes < 0:
            raise ConfigError(f"in_step_ssd_bytes must be >= 0, not {in_step_ssd_bytes}")
        self.store = store
        self.block_size = block_size
        self.hashes_per_block = block_size // hash_block_size
        # One namespace per KV shard (tensor-parallel rank); a hit must hold in all of them.
        self.shard_namespaces = shard_namespaces
        self.load_policy = load_policy
        self.lease_in_lookup = lease_in_lookup
        self.block_bytes = block_bytes
        self.in_step_ssd_bytes = in_step_ssd_bytes
        self.announcer = announcer
        self.on_missing = on_missing
        self._tracked: dict[str, _Tracked] = {}
        self._ready_loads: dict[str, LoadSpec] = {}
        self._holds = PrefixHolds() if hold_shared_prefixes else None
        self.counters = {
            "lookups": 0,
            "hit_blocks": 0,
            "async_loads": 0,
            "saved_blocks": 0,
            "held_lookups": 0,  # lookups answered "later": an older request brings the blocks
            "idle_steps": 0,  # steps that scheduled no tokens (waiting for async loads, ...)
            "grants_let_go": 0,  # leases a lookup took that no load read under
        }

    # ---- keys ------------------------------------------------------------------------------
    def block_keys(self, request: Any, blocks: int) -> list[bytes]:
        """The key of vLLM block i is the hash chained through its last hash block."""
        hashes = request.block_hashes
        step = self.hashes_per_block
        blocks = min(blocks, len(hashes) // step)
        return [bytes(hashes[(i + 1) * step - 1]) for i in range(blocks)]

    def _track(self, request: Any) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = _Tracked(request, tenant_of(request))
            self._tracked[request.request_id] = tracked
        return tracked

    def _probe(
        self, tracked: _Tracked, keys: list[bytes], lease: bool
    ) -> tuple[Probe, tuple[tuple[str, Any], ...]]:
        """The hits every shard holds, and with ``lease`` the grants of the shards whose
        lease covers exactly those (any other is let go)."""
        if not keys:
            return Probe(0, False), ()
        probes = {
            shard + tracked.tenant: self.store.probe(
                keys, namespace=shard + tracked.tenant, lease=lease
            )
            for shard in self.shard_namespaces
        }
        hits = min(probe.hits for probe in probes.values())
        exact: list[tuple[str, Any]] = []
        longer: list[tuple[str, Any]] = []
        for namespace, probe in probes.items():
            if probe.grant is not None:
                (exact if probe.hits == hits else longer).append((namespace, probe.grant))
        self._let_go(tuple(longer))
        return Probe(hits, any(probe.on_ssd for probe in probes.values())), tuple(exact)

    def _let_go(self, grants: tuple[tuple[str, Any], ...]) -> None:
        """Give back leases no load will read under (the next lookup there carries them)."""
        for _, grant in grants:
            self.store.let_go(grant)
        self.counters["grants_let_go"] += len(grants)

    # ---- vLLM scheduler hooks --------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        self._track(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracked = self._track(request)
        self._withdraw_offer(tracked)  # vLLM asks again: it took no blocks for the last one
        if self._holds is not None and self._holds.is_held(request.request_id):
            self.counters["held_lookups"] += 1
            return None, False
        # The last prompt token is always recomputed: vLLM needs its logits.
        loadable = (request.num_tokens - 1) // self.block_size
        keys = self.block_keys(request, loadable)
        local_blocks = num_computed_tokens // self.block_size
        # Lease in the lookup when the load would read every key asked about (vLLM has
        # none of the blocks): the worker then restores under it without a call of its own.
        probe, grants = self._probe(tracked, keys, lease=self.lease_in_lookup and not local_blocks)
        self.counters["lookups"] += 1
        if self.on_missing is not None and probe.hits < len(keys):
            self.on_missing(keys[probe.hits :])
        tracked.saved_blocks = max(tracked.saved_blocks, probe.hits)
        tracked.hit_on_ssd = probe.on_ssd
        if self._held(request.request_id, keys, keys[local_blocks : probe.hits], probe.on_ssd):
            self._let_go(grants)
            return None, False
        if probe.hits <= local_blocks:
            self._let_go(grants)
            return 0, False
        is_async = self._loads_async(probe.on_ssd, probe.hits - local_blocks)
        tracked.offer = LoadSpec(
            request.request_id,
            tuple(keys[local_blocks : probe.hits]),
            (local_blocks,),  # first block index; real block ids arrive after allocation
            tracked.tenant,
            is_async,
            grants,
        )
        return (probe.hits - local_blocks) * self.block_size, is_async

    def _withdraw_offer(self, tracked: _Tracked) -> None:
        offer, tracked.offer = tracked.offer, None
        if offer is not None:
            self._let_go(offer.grants)

    def _loads_async(self, on_ssd: bool, blocks: int) -> bool:
        """Whether a hit of ``blocks`` loads between steps (vLLM's asynchronous load): with
        ``auto``, a read that touches SSD and is too big to read inside the step."""
        if self.load_policy != "auto":
            return self.load_policy == "always"
        return on_ssd and blocks * self.block_bytes > self.in_step_ssd_bytes

    def _held(self, req_id: str, brings: list[bytes], loads: list[bytes], on_ssd: bool) -> bool:
        """Register that ``req_id`` brings ``brings`` into HBM; True if it must wait for an
        older request that brings blocks it would load from SSD."""
        if self._holds is None:
            return False
        held = self._holds.register(req_id, brings, loads if on_ssd else ())
        self.counters["held_lookups"] += int(held)
        return held

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tracked = self._track(request)
        block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        if block_ids:
            tracked.block_ids = block_ids
        if num_external_tokens <= 0 or tracked.offer is None:
            self._withdraw_offer(tracked)
            return
        offer, tracked.offer = tracked.offer, None
        count = num_external_tokens // self.block_size
        grants = offer.grants
        if count != len(offer.keys):  # a lease covers the keys it was taken for, no fewer
            self._let_go(grants)
            grants = ()
        first = offer.block_ids[0]
        load = LoadSpec(
            offer.req_id,
            offer.keys[:count],
            tuple(block_ids[first : first + count]),
            offer.tenant,
            offer.is_async,
            grants,
        )
        self._ready_loads[request.request_id] = load
        self.counters["hit_blocks"] += count
        self.counters["async_loads"] += int(load.is_async)

    def build_step(self, scheduler_output: Any) -> StepPlan:
        loads = tuple(self._ready_loads.values())
        self._ready_loads.clear()
        saves: list[SaveSpec] = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            self._step_done(tracked, new.num_computed_tokens + scheduled[new.req_id], saves)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            self._follow_blocks(tracked, cached.new_block_ids[i], req_id in cached.resumed_req_ids)
            self._step_done(tracked, cached.num_computed_tokens[i] + scheduled[req_id], saves)
        idle = scheduler_output.total_num_scheduled_tokens == 0
        self.counters["idle_steps"] += int(idle)
        return StepPlan(loads, tuple(_drop_repeated_keys(saves)), idle)

    def _step_done(self, tracked: _Tracked, tokens_after_step: int, saves: list[SaveSpec]) -> None:
        request = tracked.request
        if self._holds is not None and tokens_after_step >= request.num_prompt_tokens:
            # Its prefill ends this step: vLLM has cached its blocks, so requests held behind
            # it find them in HBM at their next lookup.
            self._holds.drop(request.request_id)
        self._plan_save(tracked, tokens_after_step, saves)

    @staticmethod
    def _follow_blocks(tracked: _Tracked, new_block_ids: Any, resumed: bool) -> None:
        if resumed:  # a resumed request's list replaces the old one (its blocks were freed)
            tracked.block_ids = list(new_block_ids[0]) if new_block_ids else []
        elif new_block_ids:
            tracked.block_ids.extend(new_block_ids[0])

    def _plan_save(self, tracked: _Tracked, tokens_after_step: int, saves: list[SaveSpec]) -> None:
        """Save every block that is full once this step runs and not stored yet, including
        blocks vLLM found in its own prefix cache (resident, so they cost a copy, no compute)."""
        request = tracked.request
        full = min(tokens_after_step // self.block_size, len(tracked.block_ids))
        keys = self.block_keys(request, full)
        first = tracked.saved_blocks
        if len(keys) <= first:
            return
        params = getattr(request, "kv_transfer_params", None) or {}
        parent = keys[first - 1] if first else None
        saves.append(
            SaveSpec(
                request.request_id,
                tuple(keys[first:]),
                tuple(tracked.block_ids[first : len(keys)]),
                tracked.tenant,
                parent,
                params.get("flatcake_session") or getattr(request, "session_id", None),
                PutHints(
                    turn=params.get("flatcake_turn"),
                    prior_reply_tokens=params.get("flatcake_prior_reply_tokens"),
                    context_tokens=len(keys) * self.block_size,
                ),
                None
                if self.announcer is None
                else self.announcer(request, keys[first:], parent, first),
            )
        )
        tracked.saved_blocks = len(keys)
        self.counters["saved_blocks"] += len(keys) - first

    def is_held(self, req_id: str) -> bool:
        """Whether ``req_id`` waits for an older request to bring its SSD blocks into HBM."""
        return self._holds is not None and self._holds.is_held(req_id)

    def last_hit_on_ssd(self, req_id: str) -> bool:
        tracked = self._tracked.get(req_id)
        return tracked is not None and tracked.hit_on_ssd

    def request_finished(self, request: Any) -> None:
        # A load already planned still runs: vLLM keeps the blocks of a request aborted while
        # waiting for its KV until the worker reports that load finished.
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is not None:
            self._withdraw_offer(tracked)
        if self._holds is not None:
            self._holds.drop(request.request_id)


def tenant_of(request: Any) -> str:
    """The namespace suffix of a request. cache_salt already changes vLLM's first block hash;
    a namespace of its own also keeps one tenant's pages out of another's accounting."""
    salt = getattr(request, "cache_salt", None)
    return f"/salt={salt}" if salt else ""


def _drop_repeated_keys(saves: list[SaveSpec]) -> list[SaveSpec]:
    """Two requests that share a prompt may fill the same blocks in one step; the store is
    write-once, so the second copy would only cost a device-to-host copy. What two saves
    share is a leading run (the common prefix), so the later one keeps its tail."""
    seen: set[tuple[str, bytes]] = set()
    kept: list[SaveSpec] = []
    for save in saves:
        lead = 0
        while lead < len(save.keys) and (save.tenant, save.keys[lead]) in seen:
            lead += 1
        seen.update((save.tenant, key) for key in save.keys)
        if lead == len(save.keys):
            continue
        if lead == 0:
            kept.append(save)
            continue
        kept.append(
            replace(
                save,
                keys=save.keys[lead:],
                block_ids=save.block_ids[lead:],
                parent=save.keys[lead - 1],
                announce=None if save.announce is None else save.announce.tail(lead),
            )
        )
    return kept
