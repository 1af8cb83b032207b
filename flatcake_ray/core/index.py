"""The Level-1 index: page-key digest -> packed location, one entry per page.

An open-addressed, linear-probing hash table in three flat numpy arrays (digest high word,
low word, value), so a page costs 24 bytes per slot at a load factor of at most 0.7
(about 34-69 bytes per page) instead of the ~200 of a Python dict of objects. Every operation
is vectorised over a batch of keys: where ``core/_digests.c`` is built (``pip install``), one
native loop a digest for the probe, the insert and the delete (a 3,421-page publish 0.15
ms); else numpy passes, a probe step at a time, never 3,421 Python steps.

The native delete shifts the entries after a removed one back into its gap (backward-shift
deletion), so its tables hold no deleted slots and churn never forces a rehash; the numpy
delete marks a slot deleted (``_DELETED_LO``), and a table that holds any stays on that path.

A value packs ``segment_id << PAGE_BITS | page_in_segment``; a page's per-layer addresses are
derived from its segment's layer-major layout, so there is no per-(page, layer) entry.
Callers publish a page only after its bytes are written (see ``store.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flatcake_ray.core.keys import DIGEST_DTYPE, native_module

PAGE_BITS = 24
PAGE_MASK = (1 << PAGE_BITS) - 1
MAX_SEGMENT_PAGES = 1 << PAGE_BITS  # a segment's pages are numbered 0 .. 2**24 - 1
MAX_LOAD = 0.7
_DELETED_LO = np.uint64(1)  # hi == 0 and lo == 1 marks a deleted slot; hi == lo == 0 an empty one


def pack_location(segment_ids: np.ndarray, pages: np.ndarray) -> np.ndarray:
    return (segment_ids.astype(np.uint64) << np.uint64(PAGE_BITS)) | pages.astype(np.uint64)


def unpack_location(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values = values.astype(np.uint64)
    return (values >> np.uint64(PAGE_BITS)).astype(np.int64), (
        values & np.uint64(PAGE_MASK)
    ).astype(np.int64)


class PageIndex:
    """Batch-vectorised hash table. Not thread-safe: the store serialises writers."""

    def __init__(self, capacity: int = 1 << 12) -> None:
        self._allocate(1 << max(4, int(capacity - 1).bit_length()))
        self.live = 0

    def _allocate(self, slots: int) -> None:
        self._hi = np.zeros(slots, dtype=np.uint64)
        self._lo = np.zeros(slots, dtype=np.uint64)
        self._val = np.zeros(slots, dtype=np.uint64)
        self._mask = np.uint64(slots - 1)
        self._deleted = 0

    def __len__(self) -> int:
        return self.live

    @property
    def nbytes(self) -> int:
        return self._hi.nbytes + self._lo.nbytes + self._val.nbytes

    def _find_slots(self, digests: np.ndarray) -> np.ndarray:
        """Slot of each digest, or -1 where absent (internal: never leaves this class); one
        native loop where ``core/_digests.c`` is built, numpy passes where it is not."""
        native = native_module()
        if native is not None:
            slots = np.empty(len(digests), dtype=np.int64)
            native.find_slots(self._hi, self._lo, np.ascontiguousarray(digests), slots)
            return slots
        return self._find_slots_numpy(digests)

    def _find_slots_numpy(self, digests: np.ndarray) -> np.ndarray:
        hi, lo = digests["hi"], digests["lo"]
        home = hi & self._mask
        slots = np.full(len(digests), -1, dtype=np.int64)
        active = np.arange(len(digests))
        step = np.uint64(0)
        while active.size:
            probe = ((home[active] + step) & self._mask).astype(np.int64)
            slot_hi, slot_lo = self._hi[probe], self._lo[probe]
            hit = (slot_hi == hi[active]) & (slot_lo == lo[active])
            slots[active[hit]] = probe[hit]
            empty = (slot_hi == 0) & (slot_lo == 0)
            active = active[~hit & ~empty]
            step += np.uint64(1)
        return slots

    def lookup(self, digests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found mask, values); values are 0 where not found."""
        slots = self._find_slots(digests)
        found = slots >= 0
        values = np.zeros(len(digests), dtype=np.uint64)
        values[found] = self._val[slots[found]]
        return found, values

    def prefix_length(self, digests: np.ndarray) -> int:
        """Consecutive hits from the first digest."""
        found, _ = self.lookup(digests)
        misses = np.flatnonzero(~found)
        return int(misses[0]) if misses.size else len(digests)

    def insert(self, digests: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Publish digests that are absent; returns the mask of the ones inserted.

        A digest already present keeps its value (write-once); a digest repeated inside the
        batch is inserted once, with its first value.
        """
        found, _ = self.lookup(digests)
        values = np.ascontiguousarray(values, dtype=np.uint64)
        native = native_module()
        if native is not None:
            self._reserve(int(np.count_nonzero(~found)))
            inserted = self._place_native(native, digests, values)
        else:
            inserted = ~found
            _, first = np.unique(digests[inserted].view(np.void), return_index=True)
            todo = np.flatnonzero(inserted)[np.sort(first)]
            inserted[:] = False
            inserted[todo] = True
            self._reserve(len(todo))
            self._place(digests, values, todo)
        self.live += int(np.count_nonzero(inserted))
        return inserted

    def _place_native(self, native: Any, digests: np.ndarray, values: np.ndarray) -> np.ndarray:
        """``core/_digests.c``'s insert: one loop a digest (numpy took a pass a probe step)."""
        inserted = np.empty(len(digests), dtype=np.bool_)
        self._deleted -= native.place_digests(
            self._hi, self._lo, self._val, np.ascontiguousarray(digests), values, inserted
        )
        return inserted

    def _place(self, digests: np.ndarray, values: np.ndarray, todo: np.ndarray) -> None:
        home = digests["hi"] & self._mask
        step = np.uint64(0)
        while todo.size:
            probe = ((home[todo] + step) & self._mask).astype(np.int64)
            free = self._hi[probe] == 0
            candidates, wanted = todo[free], probe[free]
            # Two keys of the batch may probe the same free slot: the first one takes it.
            taken, first = np.unique(wanted, return_index=True)
            winners = candidates[first]
            self._deleted -= int(np.count_nonzero(self._lo[taken] == _DELETED_LO))
            self._hi[taken] = digests["hi"][winners]
            self._lo[taken] = digests["lo"][winners]
            self._val[taken] = values[winners]
            todo = np.setdiff1d(todo, winners, assume_unique=True)
            step += np.uint64(1)

    def delete(self, digests: np.ndarray) -> int:
        """Remove the digests that are present; returns how many were."""
        native = native_module()
        if native is not None and self._deleted == 0:  # no deleted slots: shifts keep it so
            removed = int(
                native.remove_digests(self._hi, self._lo, self._val, np.ascontiguousarray(digests))
            )
            self.live -= removed
            return removed
        slots = self._find_slots(digests)
        slots = np.unique(slots[slots >= 0])
        self._hi[slots] = 0
        self._lo[slots] = _DELETED_LO
        self._val[slots] = 0
        self._deleted += len(slots)
        self.live -= len(slots)
        return len(slots)

    def _reserve(self, extra: int) -> None:
        slots = len(self._hi)
        if self.live + self._deleted + extra <= MAX_LOAD * slots:
            return
        while self.live + extra > MAX_LOAD * slots:
            slots *= 2
        self._rehash(max(slots, len(self._hi)))

    def _rehash(self, slots: int) -> None:
        keep = self._hi != 0
        digests = np.empty(int(keep.sum()), dtype=DIGEST_DTYPE)
        digests["hi"], digests["lo"] = self._hi[keep], self._lo[keep]
        values = self._val[keep]
        self._allocate(slots)
        native = native_module()
        if native is not None:
            self._place_native(native, digests, values)
        else:
            self._place(digests, values, np.arange(len(digests)))
