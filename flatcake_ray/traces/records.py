"""The one in-memory request type every trace reader produces, and a columnar trace.

:class:`TraceRequest` is one request of any trace format (Mooncake, Qwen Bailian, generic
JSONL, synthetic). :class:`Trace` holds a whole trace in numpy columns (all block ids of all
requests in one flat array plus offsets), so a trace of ~100K requests with thousands of
blocks each costs ~4-8 bytes per block id, not a Python object per id.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

NO_VALUE = -1
"""Stored in the integer columns of :class:`Trace` where a request has no session or turn."""


@dataclass(frozen=True, slots=True, eq=False)
class TraceRequest:
    """One request of a trace.

    ``blocks`` is a read-only 1-D integer array of the request's prefix block ids, in prompt
    order; one id covers ``block_tokens`` tokens (the last block may be partial). ``eq`` is
    off because numpy arrays do not compare to a single bool; compare fields instead.
    """

    arrival_s: float
    session: str | None
    turn: int | None
    blocks: np.ndarray
    input_tokens: int
    output_tokens: int
    block_tokens: int

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[0])


def frozen_blocks(values: Iterable[int] | np.ndarray) -> np.ndarray:
    """A read-only int64 copy of ``values``, for :attr:`TraceRequest.blocks`."""
    array = np.array(values, dtype=np.int64, copy=True).reshape(-1)
    array.flags.writeable = False
    return array


def _smallest_id_dtype(max_id: int, min_id: int) -> type:
    # Halves the memory of large traces: synthetic and Mooncake ids all fit in int32.
    if min_id >= 0 and max_id < 2**31:
        return np.int32
    return np.int64


class Trace:
    """A whole trace in columns; iterate it to get :class:`TraceRequest` objects back.

    Sessions are stored as codes into :attr:`session_names` (``NO_VALUE`` = none), turns as
    ints (``NO_VALUE`` = none).
    """

    def __init__(
        self,
        *,
        arrival_s: np.ndarray,
        session_codes: np.ndarray,
        session_names: list[str],
        turns: np.ndarray,
        input_tokens: np.ndarray,
        output_tokens: np.ndarray,
        block_tokens: np.ndarray,
        block_ids: np.ndarray,
        block_offsets: np.ndarray,
    ) -> None:
        self.arrival_s = arrival_s
        self.session_codes = session_codes
        self.session_names = session_names
        self.turns = turns
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.block_tokens = block_tokens
        self.block_ids = block_ids
        self.block_offsets = block_offsets
        for column in (block_ids, arrival_s, session_codes, turns):
            column.flags.writeable = False

    @classmethod
    def from_requests(cls, requests: Iterable[TraceRequest]) -> Trace:
        columns = _Columns()
        for request in requests:
            columns.append(request)
        return columns.build()

    def __len__(self) -> int:
        return int(self.arrival_s.shape[0])

    def __iter__(self) -> Iterator[TraceRequest]:
        for index in range(len(self)):
            yield self[index]

    def __getitem__(self, index: int) -> TraceRequest:
        if not -len(self) <= index < len(self):
            raise IndexError(f"request {index} out of range for a trace of {len(self)}")
        index %= len(self)
        code = int(self.session_codes[index])
        turn = int(self.turns[index])
        return TraceRequest(
            arrival_s=float(self.arrival_s[index]),
            session=None if code == NO_VALUE else self.session_names[code],
            turn=None if turn == NO_VALUE else turn,
            blocks=self.blocks_of(index),
            input_tokens=int(self.input_tokens[index]),
            output_tokens=int(self.output_tokens[index]),
            block_tokens=int(self.block_tokens[index]),
        )

    def blocks_of(self, index: int) -> np.ndarray:
        """The block ids of request ``index`` (a read-only view, no copy)."""
        start, stop = self.block_offsets[index], self.block_offsets[index + 1]
        return self.block_ids[start:stop]

    @property
    def num_block_accesses(self) -> int:
        return int(self.block_ids.shape[0])

    def with_sessions(
        self, session_codes: np.ndarray, names: list[str], turns: np.ndarray
    ) -> Trace:
        """A copy of this trace whose sessions and turns are replaced (e.g. inferred ones)."""
        return Trace(
            arrival_s=self.arrival_s,
            session_codes=np.array(session_codes, dtype=np.int32),
            session_names=list(names),
            turns=np.array(turns, dtype=np.int32),
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            block_tokens=self.block_tokens,
            block_ids=self.block_ids,
            block_offsets=self.block_offsets,
        )


class _Columns:
    """Accumulates requests into Python lists of scalars and numpy chunks of ids."""

    def __init__(self) -> None:
        self.arrival: list[float] = []
        self.codes: list[int] = []
        self.names: dict[str, int] = {}
        self.turns: list[int] = []
        self.inputs: list[int] = []
        self.outputs: list[int] = []
        self.block_tokens: list[int] = []
        self.chunks: list[np.ndarray] = []
        self.lengths: list[int] = []

    def append(self, request: TraceRequest) -> None:
        self.arrival.append(request.arrival_s)
        if request.session is None:
            self.codes.append(NO_VALUE)
        else:
            self.codes.append(self.names.setdefault(request.session, len(self.names)))
        self.turns.append(NO_VALUE if request.turn is None else request.turn)
        self.inputs.append(request.input_tokens)
        self.outputs.append(request.output_tokens)
        self.block_tokens.append(request.block_tokens)
        self.chunks.append(request.blocks)
        self.lengths.append(request.num_blocks)

    def build(self) -> Trace:
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        ids = np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=np.int64)
        if ids.size:
            ids = ids.astype(_smallest_id_dtype(int(ids.max()), int(ids.min())), copy=False)
        return Trace(
            arrival_s=np.asarray(self.arrival, dtype=np.float64),
            session_codes=np.asarray(self.codes, dtype=np.int32),
            session_names=list(self.names),
            turns=np.asarray(self.turns, dtype=np.int32),
            input_tokens=np.asarray(self.inputs, dtype=np.int64),
            output_tokens=np.asarray(self.outputs, dtype=np.int64),
            block_tokens=np.asarray(self.block_tokens, dtype=np.int32),
            block_ids=ids,
            block_offsets=offsets,
        )
