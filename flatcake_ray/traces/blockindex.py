"""Per-block state for one pass over a trace, in growable numpy arrays.

Block ids are mapped to dense codes first. Traces whose ids are small non-negative integers
(Mooncake, synthetic: ``0 .. unique-1``) use the id itself as its code, so a request costs a
few vectorised numpy operations; other ids (large hashes, negative values) fall back to a
dict, which is fine for the few million distinct ids of the real traces. The switch happens
once, the first time an id does not fit, and keeps every code already handed out.
"""

from __future__ import annotations

import numpy as np

# Identity codes are used while the largest id stays below both bounds, so a trace with
# a few huge hash values cannot make the arrays sparse and enormous.
_IDENTITY_HARD_LIMIT = 1 << 28
_IDENTITY_SPARSE_FACTOR = 8
_IDENTITY_FLOOR = 1 << 20


class BlockIndex:
    """Dense codes of block ids, with each block's last request and request count."""

    def __init__(self) -> None:
        self._table: dict[int, int] | None = None
        self.capacity = 0
        self.size = 0  # codes in use: identity mode counts max id + 1, dict mode distinct ids
        self.last_request = np.zeros(0, dtype=np.int32)
        self.requests_seen = np.zeros(0, dtype=np.int32)
        self.fanout = np.zeros(0, dtype=np.int32)
        self._stamp = np.zeros(0, dtype=np.int32)

    def codes_of(self, ids: np.ndarray, accesses_so_far: int) -> np.ndarray:
        """Dense codes of ``ids`` (new ids get new codes), growing the arrays as needed."""
        if ids.size == 0:
            return np.zeros(0, dtype=np.int64)
        if self._table is None and self._fits_identity(ids, accesses_so_far):
            codes = ids.astype(np.int64, copy=False)
            self.size = max(self.size, int(codes.max()) + 1)
        else:
            codes = self._dict_codes(ids)
        self._grow(self.size)
        return codes

    def _fits_identity(self, ids: np.ndarray, accesses_so_far: int) -> bool:
        low, high = int(ids.min()), int(ids.max())
        bound = max(_IDENTITY_FLOOR, _IDENTITY_SPARSE_FACTOR * (accesses_so_far + ids.size))
        if low >= 0 and high < min(_IDENTITY_HARD_LIMIT, bound):
            return True
        self._switch_to_dict()
        return False

    def _switch_to_dict(self) -> None:
        # Codes already given out stay valid: the seen ids keep their identity codes.
        seen = np.flatnonzero(self.last_request[: self.size] >= 0)
        self._table = dict(zip(seen.tolist(), seen.tolist(), strict=True))

    def _dict_codes(self, ids: np.ndarray) -> np.ndarray:
        table = self._table
        assert table is not None
        next_code = self.size

        def code(block_id: int) -> int:
            nonlocal next_code
            found = table.get(block_id)
            if found is None:
                found = table[block_id] = next_code
                next_code += 1
            return found

        codes = np.fromiter(map(code, ids.tolist()), dtype=np.int64, count=ids.size)
        self.size = next_code
        return codes

    def _grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_capacity = max(needed, 2 * self.capacity, 1024)
        self.last_request = _grown(self.last_request, new_capacity, fill=-1)
        self.requests_seen = _grown(self.requests_seen, new_capacity, fill=0)
        self.fanout = _grown(self.fanout, new_capacity, fill=0)
        self._stamp = _grown(self._stamp, new_capacity, fill=0)
        self.capacity = new_capacity

    def distinct(self, codes: np.ndarray) -> np.ndarray:
        """``codes`` with repeats dropped (order kept): a request loads a block once."""
        if codes.size < 2:
            return codes
        positions = np.arange(codes.size, dtype=np.int32)
        # Whichever duplicate's write lands, exactly one position per code reads back its own
        # number; two fancy-index passes instead of a sort per request.
        self._stamp[codes] = positions
        keep = self._stamp[codes] == positions
        return codes if bool(keep.all()) else codes[keep]

    @property
    def distinct_blocks(self) -> int:
        return int(np.count_nonzero(self.requests_seen[: self.size]))

    def blocks_seen_once(self) -> int:
        return int(np.count_nonzero(self.requests_seen[: self.size] == 1))


def _grown(array: np.ndarray, capacity: int, *, fill: int) -> np.ndarray:
    grown = np.full(capacity, fill, dtype=array.dtype)
    grown[: array.shape[0]] = array
    return grown
