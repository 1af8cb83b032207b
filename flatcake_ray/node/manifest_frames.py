"""The manifest's record framing (format 2): every record checked on its own, resynchronisable.

A record is two copies of a 32-byte header, then its msgpack payload::

    magic  b"\\xc1FC" + copy ("A" or "B")   4 bytes
    length of the payload                   u32
    scope id (0: not a scope's record)      u64
    xxh3-64 of the payload                  u64
    xxh3-64 of the 24 bytes above           u64

Why two copies: a damaged header would hide which scope the record belongs to and where the
next record starts; with two independently checked copies, one damaged byte anywhere in a
record costs at most that record's payload, and the scope it belongs to is still known.
Where both copies are damaged, the reader looks for the next valid header (magic plus a
matching header checksum), so the records after the damage are still read. ``0xc1`` never
begins a msgpack object, so a format 1 manifest (bare msgpack) never reads as format 2.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import msgpack
import xxhash

MAGIC = b"\xc1FC"
COPIES = (b"A", b"B")
_HEADER = struct.Struct("<4sIQQ")  # magic+copy, length, scope, payload checksum
HEADER_BYTES = _HEADER.size + 8
FRAME_OVERHEAD = 2 * HEADER_BYTES
MAX_PAYLOAD = (1 << 32) - 1


def _header(copy: bytes, length: int, scope: int, check: int) -> bytes:
    body = _HEADER.pack(MAGIC + copy, length, scope, check)
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")


def encode_frame(scope: int, payload: bytes) -> bytes:
    """One record: both header copies, then the payload."""
    if not 0 <= scope < 1 << 64 or len(payload) > MAX_PAYLOAD:
        raise ValueError(f"scope {scope} or payload of {len(payload)} bytes does not fit a frame")
    check = xxhash.xxh3_64_intdigest(payload)
    return b"".join(_header(copy, len(payload), scope, check) for copy in COPIES) + payload


def encode_record(scope: int, record: dict) -> bytes:
    return encode_frame(scope, msgpack.packb(record, use_bin_type=True))


@dataclass(frozen=True)
class Header:
    copy: int  # 0 or 1: where this header copy sits in its record
    length: int
    scope: int
    check: int


def header_at(data: bytes | memoryview, pos: int) -> Header | None:
    """The header copy at ``pos`` if one is there and its checksum holds."""
    end = pos + HEADER_BYTES
    if pos < 0 or end > len(data) or bytes(data[pos : pos + 3]) != MAGIC:
        return None
    body = bytes(data[pos : end - 8])
    if xxhash.xxh3_64_intdigest(body) != int.from_bytes(data[end - 8 : end], "little"):
        return None
    tag, length, scope, check = _HEADER.unpack(body)
    if tag[3:] not in COPIES:
        return None
    return Header(COPIES.index(tag[3:]), length, scope, check)


def record_header(data: bytes | memoryview, pos: int) -> Header | None:
    """The header of a record starting at ``pos``, from whichever copy is intact."""
    first = header_at(data, pos)
    if first is not None and first.copy == 0:
        return first
    second = header_at(data, pos + HEADER_BYTES)
    return second if second is not None and second.copy == 1 else None


def resync(data: bytes, start: int) -> int | None:
    """The start of the first record at or after ``start`` that has an intact header."""
    pos = data.find(MAGIC, start)
    while pos >= 0:
        found = header_at(data, pos)
        if found is not None:
            begin = pos - found.copy * HEADER_BYTES
            if begin >= start and record_header(data, begin) is not None:
                return begin
        pos = data.find(MAGIC, pos + 1)
    return None


@dataclass(frozen=True)
class Frame:
    """One record as found: its payload when intact, else why it is not."""

    offset: int
    nbytes: int
    scope: int | None  # None: the header was unreadable, so the scope is unknown
    payload: bytes | None
    fault: str | None  # None, "checksum", "header" or "torn"


def frames(data: bytes) -> Iterator[Frame]:
    """Every record of a manifest body, intact or not, in order."""
    pos = 0
    while pos < len(data):
        head = record_header(data, pos)
        if head is None:
            following = resync(data, pos + 1)
            end = len(data) if following is None else following
            # A crash mid-append leaves less than both header copies; more than that, unread,
            # is damage.
            torn = following is None and end - pos < FRAME_OVERHEAD
            yield Frame(pos, end - pos, None, None, "torn" if torn else "header")
            pos = end
            continue
        end = pos + FRAME_OVERHEAD + head.length
        if end > len(data):  # a crash mid-append leaves the last record short
            yield Frame(pos, len(data) - pos, head.scope, None, "torn")
            return
        payload = data[pos + FRAME_OVERHEAD : end]
        intact = xxhash.xxh3_64_intdigest(payload) == head.check
        fault = None if intact else "checksum"
        yield Frame(pos, end - pos, head.scope, payload if intact else None, fault)
        pos = end
