"""The caches the live store does not have: an LRU of pages (GPU HBM prefix cache; the tiered
systems' DRAM tier) and the tiered systems' FIFO-bucket SSD tier.

Both work on a request's pages in batches. Their key -> slot map is a :class:`KeyMap` (a dict
driven by C-level ``map``/``zip``), not the live :class:`~flatcake_ray.index.PageIndex`:
these tiers insert and delete on every request, a few pages at a time, and the index's
fixed cost a batch (its numpy passes, or a native call with its checks) is paid per request
(under churn its numpy fallback also leaves deleted slots that lengthen probe chains until
the next rehash), while a dict costs ~50 ns a page whatever the churn. A page is keyed by
its digest's low word, which the replay's digests make unique (see ``pages.py``).
"""

from __future__ import annotations

from collections import deque
from itertools import repeat

import numpy as np

from flatcake_ray.config import ALIGN
from flatcake_ray.core.keys import DIGEST_DTYPE
from flatcake_ray.errors import ConfigError

_NEVER = np.iinfo(np.int64).max


class KeyMap:
    """uint64 key -> int64 value, in batches."""

    def __init__(self) -> None:
        self._map: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._map)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found mask, values); values are -1 where not found."""
        values = np.fromiter(
            map(self._map.get, keys.tolist(), repeat(-1)), dtype=np.int64, count=len(keys)
        )
        return values >= 0, values

    def prefix_length(self, keys: np.ndarray) -> int:
        found, _ = self.lookup(keys)
        misses = np.flatnonzero(~found)
        return int(misses[0]) if misses.size else len(keys)

    def insert(self, keys: np.ndarray, values: np.ndarray) -> None:
        self._map.update(zip(keys.tolist(), values.tolist(), strict=True))

    def add_new(self, keys: np.ndarray) -> int:
        """Insert absent keys (value 0); returns how many were absent."""
        before = len(self._map)
        self._map.update(zip(keys.tolist(), repeat(0)))
        return len(self._map) - before

    def delete(self, keys: np.ndarray) -> int:
        before = len(self._map)
        deque(map(self._map.pop, keys.tolist(), repeat(None)), maxlen=0)
        return before - len(self._map)


class PageLru:
    """A set of at most ``capacity`` pages, least recently used evicted first.

    Within one touch the first page counts as the most recent, so a prefix loses its tail
    before its head (a prefix without its head is worthless). Pinned pages are never evicted.
    For speed an eviction frees at least ``capacity // 64`` slots at once: LRU order is kept,
    the cache just runs up to 1.6% below capacity between evictions.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ConfigError("an LRU capacity must be >= 0")
        self.capacity = capacity
        self.index = KeyMap()
        self.stamp = np.full(capacity, _NEVER, dtype=np.int64)
        self.pins = np.zeros(capacity, dtype=np.int32)
        self.digests = np.zeros(capacity, dtype=DIGEST_DTYPE)
        self.used = np.zeros(capacity, dtype=bool)
        self.owner = np.full(capacity, -1, dtype=np.int64)  # e.g. the session that wrote it
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack
        self._free_count = capacity
        self._clock = 0
        self.evicted = 0

    def __len__(self) -> int:
        return self.capacity - self._free_count

    def slots(self, digests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.index.lookup(digests["lo"])

    def prefix(self, digests: np.ndarray) -> int:
        """Leading pages of ``digests`` that are cached."""
        return self.index.prefix_length(digests["lo"])

    def touch(self, slots: np.ndarray) -> None:
        count = len(slots)
        self.stamp[slots] = self._clock + count - np.arange(count)
        self._clock += count + 1

    def pin(self, slots: np.ndarray, delta: int) -> None:
        """Pin (+1) or unpin (-1); pass the same ``slots`` both times (a slot repeated in one
        call counts once, on the way in and out alike)."""
        self.pins[slots] += delta

    def insert(self, digests: np.ndarray, owner: int = -1) -> tuple[np.ndarray, np.ndarray]:
        """Cache ``digests`` (touching those present); returns the digests that leave, with
        their owners: the evicted ones, oldest first, then any of ``digests`` that found no
        room (the tail of a batch larger than what is not pinned)."""
        found, slots = self.slots(digests)
        missing = np.flatnonzero(~found)
        evicted = np.zeros(0, dtype=DIGEST_DTYPE), np.zeros(0, dtype=np.int64)
        if missing.size > self._free_count:
            evicted = self._evict(missing.size - self._free_count, protect=slots[found])
        refused = missing[self._free_count :]
        if refused.size:
            evicted = (
                np.concatenate([evicted[0], digests[refused]]),
                np.concatenate([evicted[1], np.full(refused.size, owner, dtype=np.int64)]),
            )
        missing = missing[: self._free_count]
        if missing.size:
            self._free_count -= missing.size
            new_slots = self._free[self._free_count : self._free_count + missing.size][::-1]
            self.used[new_slots] = True
            self.digests[new_slots] = digests[missing]
            self.owner[new_slots] = owner
            self.index.insert(digests[missing]["lo"], new_slots)
            slots[missing] = new_slots
            found[missing] = True
        self.touch(slots[found])
        return evicted

    def remove(self, digests: np.ndarray) -> None:
        found, slots = self.slots(digests)
        self._release(slots[found])

    def _evict(self, need: int, protect: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        evictable = self.used & (self.pins == 0)
        evictable[protect] = False
        candidates = np.flatnonzero(evictable)
        want = min(len(candidates), max(need, self.capacity // 64))
        if want == 0:
            return np.zeros(0, dtype=DIGEST_DTYPE), np.zeros(0, dtype=np.int64)
        chosen = self._choose(candidates, want)
        gone, owners = self.digests[chosen].copy(), self.owner[chosen].copy()
        self._release(chosen)
        self.evicted += len(chosen)
        return gone, owners

    def _choose(self, candidates: np.ndarray, want: int) -> np.ndarray:
        """The ``want`` slots of ``candidates`` to evict, in eviction order: least recent."""
        if want < len(candidates):
            candidates = candidates[np.argpartition(self.stamp[candidates], want - 1)[:want]]
        return candidates[np.argsort(self.stamp[candidates], kind="stable")]

    def _release(self, slots: np.ndarray) -> None:
        if not slots.size:
            return
        self.index.delete(self.digests[slots]["lo"])
        self.used[slots] = False
        self.stamp[slots] = _NEVER
        self._free[self._free_count : self._free_count + len(slots)] = slots
        self._free_count += len(slots)


class FifoBucketSsd:
    """Mooncake-style SSD tier: page objects appended to fixed-size buckets in the order DRAM
    evicts them, and buckets recycled whole, oldest first, when the SSD is full.

    A page object holds all layers of one page (page-major), ``object_bytes`` aligned. A
    recycled bucket drops every page in it, whichever sessions they belong to.
    """

    def __init__(self, capacity_bytes: int, buckets: int, object_bytes: int) -> None:
        if buckets < 1 or object_bytes < 1:
            raise ConfigError("need at least one bucket and a positive object size")
        self.object_bytes = -(-object_bytes // ALIGN) * ALIGN
        buckets = max(1, min(buckets, capacity_bytes // self.object_bytes))  # >= 1 object each
        self.bucket_bytes = capacity_bytes // buckets // self.object_bytes * self.object_bytes
        self.per_bucket = self.bucket_bytes // self.object_bytes
        self.buckets = buckets if self.per_bucket else 0
        self.index = KeyMap()  # digest low word -> bucket * per_bucket + slot
        self.contents: list[list[np.ndarray]] = [[] for _ in range(max(self.buckets, 1))]
        self.owners: list[list[np.ndarray]] = [[] for _ in range(max(self.buckets, 1))]
        self._current = 0
        self._filled = 0
        self._in_use = 1
        self.counters = {"buckets_recycled": 0, "pages_invalidated": 0, "cross_session_buckets": 0}

    def lookup(self, digests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found mask, (bucket, byte offset) locations as a [n, 2] array)."""
        found, values = self.index.lookup(digests["lo"])
        where = np.stack([values // max(self.per_bucket, 1), values % max(self.per_bucket, 1)], 1)
        where[:, 1] *= self.object_bytes
        return found, where

    def append(self, digests: np.ndarray, owners: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write the objects of ``digests`` not yet stored; returns the written objects' pool
        offsets (bucket * bucket_bytes + offset) and digests, in write order."""
        if not self.buckets or not len(digests):
            return np.zeros(0, dtype=np.int64), digests[:0]
        found, _ = self.index.lookup(digests["lo"])
        todo = np.flatnonzero(~found)
        if not todo.size:
            return np.zeros(0, dtype=np.int64), digests[:0]
        _, first = np.unique(digests["lo"][todo], return_index=True)
        todo = todo[np.sort(first)]
        written: list[np.ndarray] = []
        written_digests = digests[todo]
        while todo.size:
            if self._filled == self.per_bucket:
                self._open_next_bucket()
            take = todo[: self.per_bucket - self._filled]
            slots = self._current * self.per_bucket + self._filled + np.arange(len(take))
            self.index.insert(digests["lo"][take], slots)
            bucket = self._current
            self.contents[bucket].append(digests[take])
            self.owners[bucket].append(owners[take])
            in_bucket = (slots % self.per_bucket) * self.object_bytes
            written.append(bucket * self.bucket_bytes + in_bucket)
            self._filled += len(take)
            todo = todo[len(take) :]
        return np.concatenate(written), written_digests

    def _open_next_bucket(self) -> None:
        self._current = (self._current + 1) % self.buckets
        self._filled = 0
        if self._in_use < self.buckets:
            self._in_use += 1
            return
        bucket = self._current  # the oldest bucket: recycled whole
        if self.contents[bucket]:
            self.counters["pages_invalidated"] += self.index.delete(
                np.concatenate(self.contents[bucket])["lo"]
            )
            if len(np.unique(np.concatenate(self.owners[bucket]))) > 1:
                self.counters["cross_session_buckets"] += 1
        self.counters["buckets_recycled"] += 1
        self.contents[bucket], self.owners[bucket] = [], []
