"""Readers for the KV-cache trace formats, and the writer of the generic format.

Formats (one JSON object per line; the format is detected from the first non-blank line;
gzip is detected by its magic bytes, whatever the file is called):

``mooncake``
    ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``.
    One hash id is one 512-token block. No session ids (see :mod:`.infer`).
``bailian`` (Qwen Bailian)
    ``{"chat_id", "parent_chat_id", "timestamp": s, "input_length", "output_length",
    "type", "turn", "hash_ids": [...]}``, 16-token blocks. ``parent_chat_id`` is -1 (or
    null) on a conversation's first request; the session of a request is the ``chat_id`` at
    the root of its parent chain (a parent missing from the trace is taken as the root).
``generic`` (this project's own; :func:`write_generic` writes it)
    ``{"t": seconds, "session": str | null, "turn": int | null, "blocks": [int, ...],
    "block_tokens": int, "input_tokens": int, "output_tokens": int}``. ``session`` and
    ``turn`` may be omitted (= null). Unknown keys are ignored in every format.

Every reader yields :class:`~.records.TraceRequest`; a line that is not valid JSON, lacks a
field, or has a field of the wrong type raises :class:`~flatcake_ray.errors.TraceFormatError`
naming the file and line.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from flatcake_ray.errors import TraceFormatError
from flatcake_ray.traces.records import Trace, TraceRequest, frozen_blocks

GZIP_MAGIC = b"\x1f\x8b"
MOONCAKE_BLOCK_TOKENS = 512
BAILIAN_BLOCK_TOKENS = 16
FORMATS = ("mooncake", "bailian", "generic")


def open_text(path: str | Path) -> IO[str]:
    """Open ``path`` for reading text, decompressing it when it starts with gzip's magic."""
    with open(path, "rb") as probe:
        magic = probe.read(len(GZIP_MAGIC))
    if magic == GZIP_MAGIC:
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def detect_format(first_line: dict[str, Any]) -> str:
    """Name the format of a parsed first line (one of :data:`FORMATS`)."""
    keys = first_line.keys()
    if "hash_ids" in keys and "chat_id" in keys:
        return "bailian"
    if "hash_ids" in keys:
        return "mooncake"
    if "blocks" in keys and "t" in keys:
        return "generic"
    raise TraceFormatError(f"unknown trace format: first line has keys {sorted(keys)}")


def iter_requests(
    path: str | Path, *, fmt: str | None = None, block_tokens: int | None = None
) -> Iterator[TraceRequest]:
    """Stream the requests of a trace file, in file order.

    ``fmt`` forces a format (default: detected); ``block_tokens`` overrides the format's
    native block size (Mooncake 512, Bailian 16; generic lines carry their own).
    """
    parse: Callable[[dict[str, Any]], TraceRequest] | None = None
    for line_no, line in _numbered_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        obj = _parse_json(line, where)
        if parse is None:
            parse = _make_parser(fmt or _detect_at(obj, where), block_tokens)
        try:
            request = parse(obj)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise TraceFormatError(f"{where}: {_describe(exc)}") from exc
        yield request


def _numbered_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    line_no = 0
    with open_text(path) as text:
        try:
            for line_no, line in enumerate(text, start=1):
                yield line_no, line
        except (UnicodeDecodeError, EOFError) as exc:
            # Binary garbage or a truncated gzip stream: the file, not the caller, is wrong.
            raise TraceFormatError(f"{path}:{line_no + 1}: unreadable: {exc}") from exc


def load_trace(
    path: str | Path, *, fmt: str | None = None, block_tokens: int | None = None
) -> Trace:
    """Read a whole trace file into a columnar :class:`~.records.Trace`."""
    return Trace.from_requests(iter_requests(path, fmt=fmt, block_tokens=block_tokens))


def parse_line(line: str, fmt: str, *, block_tokens: int | None = None) -> TraceRequest:
    """Parse one line of a known format (for tests and tools that work line by line)."""
    obj = _parse_json(line, "<line>")
    try:
        return _make_parser(fmt, block_tokens)(obj)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise TraceFormatError(f"<line>: {_describe(exc)}") from exc


def _parse_json(line: str, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: a trace line must be a JSON object")
    return obj


def _detect_at(obj: dict[str, Any], where: str) -> str:
    try:
        return detect_format(obj)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{where}: {exc}") from exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"missing field {exc}"
    return str(exc)


def _make_parser(fmt: str, block_tokens: int | None) -> Callable[[dict[str, Any]], TraceRequest]:
    if fmt == "mooncake":
        return _MooncakeParser(block_tokens or MOONCAKE_BLOCK_TOKENS)
    if fmt == "bailian":
        return _BailianParser(block_tokens or BAILIAN_BLOCK_TOKENS)
    if fmt == "generic":
        return _GenericParser(block_tokens)
    raise TraceFormatError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")


def _int_field(obj: dict[str, Any], key: str, *, minimum: int = 0) -> int:
    value = obj[key]
    # bool is an int in Python; a true/false token count is a broken line, not 1/0.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"field {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"field {key!r} must be >= {minimum}, got {value}")
    return value


def _number_field(obj: dict[str, Any], key: str) -> float:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"field {key!r} must be a number, got {value!r}")
    return float(value)


def _blocks_field(obj: dict[str, Any], key: str) -> np.ndarray:
    values = obj[key]
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise TypeError(f"field {key!r} must be a list of integers")
    return frozen_blocks(values)


class _MooncakeParser:
    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens

    def __call__(self, obj: dict[str, Any]) -> TraceRequest:
        return TraceRequest(
            arrival_s=_number_field(obj, "timestamp") / 1000.0,
            session=None,
            turn=None,
            blocks=_blocks_field(obj, "hash_ids"),
            input_tokens=_int_field(obj, "input_length"),
            output_tokens=_int_field(obj, "output_length"),
            block_tokens=self.block_tokens,
        )


class _BailianParser:
    """Keeps chat_id -> root chat_id so each request gets its conversation's root as session."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.root_of: dict[int, int] = {}

    def _root(self, obj: dict[str, Any]) -> int:
        chat_id = _int_field(obj, "chat_id", minimum=-(2**63))
        parent = obj.get("parent_chat_id")
        if parent is None or parent == -1:
            root = chat_id
        else:
            parent = _int_field(obj, "parent_chat_id", minimum=-(2**63))
            root = self.root_of.get(parent, parent)
        self.root_of[chat_id] = root
        return root

    def __call__(self, obj: dict[str, Any]) -> TraceRequest:
        turn = obj.get("turn")
        return TraceRequest(
            arrival_s=_number_field(obj, "timestamp"),
            session=str(self._root(obj)),
            turn=None if turn is None else _int_field(obj, "turn"),
            blocks=_blocks_field(obj, "hash_ids"),
            input_tokens=_int_field(obj, "input_length"),
            output_tokens=_int_field(obj, "output_length"),
            block_tokens=self.block_tokens,
        )


class _GenericParser:
    def __init__(self, block_tokens: int | None) -> None:
        self.block_tokens = block_tokens

    def __call__(self, obj: dict[str, Any]) -> TraceRequest:
        session = obj.get("session")
        if session is not None and not isinstance(session, str):
            raise TypeError(f"field 'session' must be a string or null, got {session!r}")
        turn = obj.get("turn")
        return TraceRequest(
            arrival_s=_number_field(obj, "t"),
            session=session,
            turn=None if turn is None else _int_field(obj, "turn"),
            blocks=_blocks_field(obj, "blocks"),
            input_tokens=_int_field(obj, "input_tokens"),
            output_tokens=_int_field(obj, "output_tokens"),
            block_tokens=self.block_tokens or _int_field(obj, "block_tokens", minimum=1),
        )


def generic_line(request: TraceRequest) -> str:
    """One line of the generic format (no trailing newline)."""
    # Hand-built: json.dumps of a 3,000-id list is several times slower than a join.
    session = "null" if request.session is None else json.dumps(request.session)
    turn = "null" if request.turn is None else str(int(request.turn))
    blocks = ",".join(map(str, request.blocks.tolist()))
    return (
        f'{{"t": {request.arrival_s:.6f}, "session": {session}, "turn": {turn}, '
        f'"block_tokens": {int(request.block_tokens)}, '
        f'"input_tokens": {int(request.input_tokens)}, '
        f'"output_tokens": {int(request.output_tokens)}, "blocks": [{blocks}]}}'
    )


def write_generic(path: str | Path, requests: Iterable[TraceRequest]) -> int:
    """Write ``requests`` as generic JSONL (gzip when ``path`` ends in ``.gz``); returns count."""
    path = Path(path)
    count = 0
    opener = _gzip_writer if path.name.endswith(".gz") else _plain_writer
    with opener(path) as out:
        for request in requests:
            out.write(generic_line(request))
            out.write("\n")
            count += 1
    return count


def _gzip_writer(path: Path) -> IO[str]:
    # Level 1: synthetic traces are large and repetitive; speed matters more than size.
    return gzip.open(path, "wt", encoding="utf-8", compresslevel=1)


def _plain_writer(path: Path) -> IO[str]:
    return open(path, "w", encoding="utf-8")
