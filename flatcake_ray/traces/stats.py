"""Table 1 of the FlatCake paper: KV reuse statistics under an infinite-capacity cache.

Requests are taken in file (arrival) order and numbered 0, 1, 2, ...; a request's blocks
are its distinct block ids (a block named twice in one request is one access). With that:

``requests``
    number of requests.
``unique_blocks``
    number of distinct block ids.
``once_access_pct``
    100 x (distinct blocks that occur in exactly one request) / ``unique_blocks``.
``reuse_distance_mean`` / ``reuse_distance_p99``
    over every re-access (a request containing a block some earlier request contained):
    ``this request's number - the number of the last earlier request containing it``.
    Mean, and the 99th percentile by numpy's default (linear) interpolation. This is the
    definition that reproduces the paper's Mooncake row (728 and 5,527) exactly; it is the
    count of intervening requests *plus one*.
``reuse_distance_intervening_mean`` / ``reuse_distance_intervening_p99``
    the same minus one: the literal count of requests strictly in between. The paper's
    Claude Code row (mean 0.85 < 1, P99 14) can only be this one, since the first
    definition is >= 1 for every re-access; both are reported so either row can be checked.
``hit_rate_pct``
    100 x (block accesses whose block some earlier request contained) / all block accesses:
    the hit rate of an infinite cache that starts empty. Equals 100 x (1 - unique/accesses).
``sessions``
    distinct session ids when every request has one, else inferred (see :mod:`.infer`).
``mean_blocks_per_request``, ``span_seconds`` (last - first arrival), ``mean_qps``
    (requests / span; 0 when the span is 0).

On the shared Mooncake conversation trace this gives: 12,031 requests, 182,790 unique
blocks, 75.85 % once-access, mean 727.63 -> 728, P99 5,527, hit rate 36.64 %, 7,373
inferred sessions.

Re-blocking (``block_tokens``): when a coarser block size that is a whole multiple ``k`` of
the native one is asked for, each run of ``k`` consecutive native blocks of a request (and
its shorter tail) becomes one block, identified by the id of its *last* native block.
Because ids are prefix-chained, that id already stands for the whole prefix up to there, so
two coarse blocks get the same id exactly when they cover the same tokens. Finer block sizes
cannot be made from coarse ids and are rejected.

One pass, one request at a time, a few numpy operations per request over growable arrays
indexed by block; distances are kept as a histogram. Memory is O(distinct blocks), not
O(accesses), so a 100K-request, 340M-access synthetic trace can be measured as it streams.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

from flatcake_ray.errors import ConfigError
from flatcake_ray.traces.blockindex import BlockIndex
from flatcake_ray.traces.infer import DEFAULT_COMMON_FANOUT, SessionInferrer
from flatcake_ray.traces.records import TraceRequest

_DISTANCE_FLUSH = 1 << 22  # distances buffered before folding them into the histogram


@dataclass(frozen=True)
class TraceStats:
    """One Table 1 row plus context; field names are the JSON keys of ``trace stats``."""

    requests: int
    unique_blocks: int
    once_access_pct: float
    reuse_distance_mean: float
    reuse_distance_p99: float
    hit_rate_pct: float
    sessions: int
    mean_blocks_per_request: float
    span_seconds: float
    mean_qps: float
    reuse_distance_intervening_mean: float
    reuse_distance_intervening_p99: float
    block_accesses: int
    block_tokens: int
    sessions_inferred: bool

    def to_dict(self) -> dict[str, float | int | bool]:
        return asdict(self)


class DistanceHistogram:
    """Exact histogram of non-negative integer distances, with numpy-linear percentiles."""

    def __init__(self) -> None:
        self.counts = np.zeros(0, dtype=np.int64)
        self._pending: list[np.ndarray] = []
        self._pending_size = 0

    def add(self, distances: np.ndarray) -> None:
        if distances.size:
            self._pending.append(distances)
            self._pending_size += distances.size
            if self._pending_size >= _DISTANCE_FLUSH:
                self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        folded = np.bincount(np.concatenate(self._pending))
        if folded.size > self.counts.size:
            folded[: self.counts.size] += self.counts
            self.counts = folded
        else:
            self.counts[: folded.size] += folded
        self._pending, self._pending_size = [], 0

    @property
    def total(self) -> int:
        self._flush()
        return int(self.counts.sum())

    def mean(self) -> float:
        total = self.total
        if total == 0:
            return 0.0
        values = np.arange(self.counts.size, dtype=np.float64)
        return float(np.dot(values, self.counts) / total)

    def percentile(self, q: float) -> float:
        """Same value as ``np.percentile(all_distances, q)`` (linear interpolation)."""
        total = self.total
        if total == 0:
            return 0.0
        rank = (total - 1) * q / 100.0
        low_rank, high_rank = int(np.floor(rank)), int(np.ceil(rank))
        cumulative = np.cumsum(self.counts)
        low = int(np.searchsorted(cumulative, low_rank, side="right"))
        high = int(np.searchsorted(cumulative, high_rank, side="right"))
        return float(low + (rank - low_rank) * (high - low))


class TraceStatsAccumulator:
    """Feed requests in arrival order with :meth:`add`; :meth:`result` gives the row."""

    def __init__(
        self, *, block_tokens: int | None = None, common_fanout: int = DEFAULT_COMMON_FANOUT
    ) -> None:
        self.target_block_tokens = block_tokens
        self.common_fanout = common_fanout
        self.index = BlockIndex()
        # Sessions are a property of requests, not of the block size: when re-blocking,
        # inference still runs on the native blocks, in an index of its own.
        self.native_index = self.index if block_tokens is None else BlockIndex()
        self.native_accesses = 0
        self.distances = DistanceHistogram()
        self.inferrer = SessionInferrer()
        self.requests = 0
        self.accesses = 0
        self.hits = 0
        self.first_arrival = float("inf")
        self.last_arrival = float("-inf")
        self.session_ids: set[str] = set()
        self.requests_without_session = 0
        self.native_block_tokens: int | None = None

    def add(self, request: TraceRequest) -> None:
        blocks = self._reblocked(request)
        codes = self.index.distinct(self.index.codes_of(blocks, self.accesses))
        previous = self.index.last_request[codes]
        if self.native_index is self.index:
            self.inferrer.observe(codes, previous, self.index)
        else:
            self._observe_native(request.blocks)
        seen_before = previous[previous >= 0]
        self.distances.add(self.requests - seen_before.astype(np.int64))
        self.hits += int(seen_before.size)
        self.accesses += int(codes.size)
        self.index.last_request[codes] = self.requests
        self.index.requests_seen[codes] += 1
        self._note_request(request)

    def _observe_native(self, blocks: np.ndarray) -> None:
        index = self.native_index
        codes = index.distinct(index.codes_of(blocks, self.native_accesses))
        self.native_accesses += int(codes.size)
        self.inferrer.observe(codes, index.last_request[codes], index)
        index.last_request[codes] = self.requests

    def _reblocked(self, request: TraceRequest) -> np.ndarray:
        if self.native_block_tokens is None:
            self.native_block_tokens = request.block_tokens
        target = self.target_block_tokens
        if target is None or target == request.block_tokens:
            return request.blocks
        return reblock(request.blocks, coarsening_factor(request.block_tokens, target))

    def _note_request(self, request: TraceRequest) -> None:
        self.requests += 1
        self.first_arrival = min(self.first_arrival, request.arrival_s)
        self.last_arrival = max(self.last_arrival, request.arrival_s)
        if request.session is None:
            self.requests_without_session += 1
        else:
            self.session_ids.add(request.session)

    def result(self) -> TraceStats:
        unique = self.index.distinct_blocks
        span = self.last_arrival - self.first_arrival if self.requests else 0.0
        inferred = self.requests_without_session > 0
        sessions = (
            self.inferrer.resolve(self.native_index, self.common_fanout).sessions
            if inferred
            else len(self.session_ids)
        )
        mean_distance = self.distances.mean()
        p99_distance = self.distances.percentile(99.0)
        has_reuse = self.hits > 0
        return TraceStats(
            requests=self.requests,
            unique_blocks=unique,
            once_access_pct=100.0 * self.index.blocks_seen_once() / unique if unique else 0.0,
            reuse_distance_mean=mean_distance,
            reuse_distance_p99=p99_distance,
            hit_rate_pct=100.0 * self.hits / self.accesses if self.accesses else 0.0,
            sessions=sessions,
            mean_blocks_per_request=self.accesses / self.requests if self.requests else 0.0,
            span_seconds=span,
            mean_qps=self.requests / span if span > 0 else 0.0,
            reuse_distance_intervening_mean=mean_distance - 1.0 if has_reuse else 0.0,
            reuse_distance_intervening_p99=p99_distance - 1.0 if has_reuse else 0.0,
            block_accesses=self.accesses,
            block_tokens=self.target_block_tokens or self.native_block_tokens or 0,
            sessions_inferred=inferred,
        )


def compute_stats(
    requests: Iterable[TraceRequest],
    *,
    block_tokens: int | None = None,
    common_fanout: int = DEFAULT_COMMON_FANOUT,
) -> TraceStats:
    """The Table 1 row of ``requests`` (in arrival order), see the module docstring."""
    accumulator = TraceStatsAccumulator(block_tokens=block_tokens, common_fanout=common_fanout)
    for request in requests:
        accumulator.add(request)
    return accumulator.result()


def coarsening_factor(native_block_tokens: int, target_block_tokens: int) -> int:
    """How many native blocks make one target block; rejects sizes that are not multiples."""
    if target_block_tokens < native_block_tokens or target_block_tokens % native_block_tokens:
        raise ConfigError(
            f"cannot re-block {native_block_tokens}-token blocks to {target_block_tokens} "
            f"tokens: the target must be a whole multiple of the native block size"
        )
    return target_block_tokens // native_block_tokens


def reblock(blocks: np.ndarray, factor: int) -> np.ndarray:
    """Coarse block ids: the id of the last native block of each run of ``factor`` blocks."""
    if factor == 1 or blocks.size == 0:
        return blocks
    coarse = blocks[factor - 1 :: factor]
    if blocks.size % factor:
        coarse = np.append(coarse, blocks[-1])
    return coarse


def format_stats(stats: TraceStats, label: str) -> str:
    """A human-readable block of lines for one trace."""
    source = "inferred" if stats.sessions_inferred else "from ids"
    return "\n".join(
        [
            f"{label}",
            f"  requests                {stats.requests:,}",
            f"  unique blocks           {stats.unique_blocks:,} ({stats.block_tokens}-token)",
            f"  once-access             {stats.once_access_pct:.1f}%",
            f"  reuse distance mean     {stats.reuse_distance_mean:,.2f} "
            f"(intervening {stats.reuse_distance_intervening_mean:,.2f})",
            f"  reuse distance P99      {stats.reuse_distance_p99:,.0f} "
            f"(intervening {stats.reuse_distance_intervening_p99:,.0f})",
            f"  hit rate                {stats.hit_rate_pct:.2f}%",
            f"  sessions                {stats.sessions:,} ({source})",
            f"  mean blocks/request     {stats.mean_blocks_per_request:,.1f}",
            f"  span                    {stats.span_seconds:,.1f} s, mean {stats.mean_qps:.3f} QPS",
        ]
    )
