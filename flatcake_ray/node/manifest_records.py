"""What a well-formed manifest record is, and which recovered scopes contradict each other.

A record that passed its checksum can still be wrong (a writer bug, a record from another
pool, a stale record a lost ``free`` let back in): every field is checked against its type
and the pool's geometry before the store sees it, so recovery never fails on a ``KeyError``
or builds a segment that reads outside its scope.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flatcake_ray.config import ALIGN
from flatcake_ray.core.index import MAX_SEGMENT_PAGES, PAGE_BITS
from flatcake_ray.core.keys import DIGEST_DTYPE
from flatcake_ray.core.put_checks import check_session_id
from flatcake_ray.core.tenants import TENANT_NAME
from flatcake_ray.errors import FlatCakeError


@dataclass
class RecoveredScope:
    """A scope as the manifest's records rebuild it, before recovery hands it to a catalog."""

    scope_id: int
    session_id: str | int | bytes
    runs: list[list[int]] = field(default_factory=list)  # [allocator, start, length, used]
    segments: list[dict[str, Any]] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)  # each segment's record, as read
    quarantined: bool = False
    last_record: int = 0  # sequence number of its latest record (newer wins an overlap)


MAX_LAYERS = 1 << 16
MAX_ID = 1 << (64 - PAGE_BITS)  # segment ids share a 64-bit index value with page numbers
_MARK_BYTE = DIGEST_DTYPE.fields["hi"][1] + 7  # type: ignore[index]  # little-endian hi: top bit


class RecordError(FlatCakeError, ValueError):
    """A manifest record that decoded but is not well formed (internal to replay)."""


def _int(record: dict[str, Any], name: str, low: int, high: int) -> int:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise RecordError(f"{name}={value!r} is not an int in [{low}, {high})")
    return value


def _bytes(record: dict[str, Any], name: str, length: int) -> bytes:
    value = record.get(name)
    if not isinstance(value, bytes) or len(value) != length:
        raise RecordError(f"{name} is not {length} bytes")
    return value


def check_runs(runs: Any, header: dict[str, Any]) -> list[list[int]]:
    """Runs as ``[allocator, start, length, used]``, each inside its own pool file."""
    file_bytes, files = header["file_bytes"], header["files"]
    if not isinstance(runs, list):
        raise RecordError("runs is not a list")
    for run in runs:
        if not isinstance(run, list) or len(run) != 4:
            raise RecordError(f"run {run!r} is not [allocator, start, length, used]")
        if any(isinstance(v, bool) or not isinstance(v, int) for v in run):
            raise RecordError(f"run {run!r} holds a non-int")
        allocator, start, length, used = run
        base = allocator * file_bytes
        if not 0 <= allocator < files or not base <= start or start + length > base + file_bytes:
            raise RecordError(f"run {run!r} is not inside one pool file")
        if length <= 0 or not 0 <= used <= length:
            raise RecordError(f"run {run!r} has a bad length or use")
    return runs


def _check_segment(record: dict[str, Any], header: dict[str, Any]) -> None:
    pages = _int(record, "pages", 1, MAX_SEGMENT_PAGES + 1)
    _int(record, "segment", 1, MAX_ID)
    offset = _int(record, "offset", 0, header["file_bytes"] * header["files"])
    digests = _bytes(record, "digests", pages * DIGEST_DTYPE.itemsize)
    if min(digests[_MARK_BYTE :: DIGEST_DTYPE.itemsize]) < 0x80:  # hi's top bit, little endian
        raise RecordError("a digest lacks its mark bit")
    layers = _int(record, "layers", 1, MAX_LAYERS + 1)  # the segment's tenant's geometry
    _int(record, "page_bytes", 1, header["file_bytes"] + 1)
    check_pages = _int(record, "check_pages", 1, MAX_SEGMENT_PAGES + 1)
    tenant = record.get("tenant")
    if not isinstance(tenant, str) or not TENANT_NAME.match(tenant):
        raise RecordError(f"tenant {tenant!r} is not a tenant name")
    blocks = -(-pages // check_pages)  # one checksum per block of pages, per layer
    _bytes(record, "checksums", 8 * layers * blocks)
    if not isinstance(record.get("sealed", False), bool):  # records before sealing lack it
        raise RecordError("sealed is not a bool")
    session = record.get("session")
    if type(session) not in (str, int, bytes) or check_session_id(session) != session:
        raise RecordError(f"session {session!r} is not a valid session id")
    runs = check_runs(record.get("runs"), header)
    if not _inside(_span(record, header), runs):
        raise RecordError(f"segment at {offset} is outside its scope's runs")


def check_record(record: Any, scope: int, header: dict[str, Any]) -> dict[str, Any]:
    """``record`` if it is a well-formed record of ``scope`` (0: the header), else RecordError."""
    if not isinstance(record, dict):
        raise RecordError(f"a record is a map, not {type(record).__name__}")
    kind = record.get("t")
    if kind == "hdr":
        if scope != 0:
            raise RecordError("a header record framed with a scope")
        return record
    if kind not in ("seg", "unseg", "free", "quarantine"):
        raise RecordError(f"unknown record kind {kind!r}")
    if _int(record, "scope", 1, MAX_ID) != scope:
        raise RecordError(f"record of scope {record['scope']} framed as scope {scope}")
    if kind == "seg":
        _check_segment(record, header)
    elif kind == "unseg":
        _int(record, "segment", 1, MAX_ID)
    elif kind == "quarantine":
        check_runs(record.get("runs"), header)
    return record


def check_live_scopes(scopes: Iterable[RecoveredScope], header: dict[str, Any]) -> dict[int, str]:
    """Scopes that cannot all be right, with why: runs overlapping another scope's (the one
    whose last record is older goes), segments overlapping each other or outside their
    scope's final runs, or a segment id recorded twice (every holder goes)."""
    scopes = list(scopes)
    bad: dict[int, str] = {}
    by_id = {scope.scope_id: scope for scope in scopes}
    runs = [(start, start + length, s.scope_id) for s in scopes for _, start, length, _ in s.runs]
    for left, right in _overlapping(runs):
        # Space is reused only after a free: the scope written earlier lost its free record.
        stale = min((left, right), key=lambda scope_id: by_id[scope_id].last_record)
        bad.setdefault(stale, "overlap")
    seen: Counter[int] = Counter()
    owners: dict[int, set[int]] = defaultdict(set)
    for scope in scopes:
        spans = [(*_span(record, header), scope.scope_id) for record in scope.segments]
        if any(_overlapping(spans)):
            bad.setdefault(scope.scope_id, "overlap")
        if not all(_inside((start, end), scope.runs) for start, end, _ in spans):
            bad.setdefault(scope.scope_id, "malformed")
        for record in scope.segments:
            seen[record["segment"]] += 1
            owners[record["segment"]].add(scope.scope_id)
    for segment_id, count in seen.items():
        if count > 1:
            for owner in owners[segment_id]:
                bad.setdefault(owner, "duplicate_segment")
    return bad


def _overlapping(extents: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """Owner pairs of overlapping ``(start, end, owner)`` extents (each one that overlaps an
    earlier extent is paired with the earlier one reaching furthest)."""
    pairs = []
    reach, reacher = -1, -1
    for start, end, owner in sorted(extents):
        if start < reach:
            pairs.append((reacher, owner))
        if end > reach:
            reach, reacher = end, owner
    return pairs


def _span(record: dict[str, Any], header: dict[str, Any]) -> tuple[int, int]:
    layer_bytes = record["pages"] * record["page_bytes"]
    stride = -(-layer_bytes // ALIGN) * ALIGN  # SegmentLayout.nbytes, without the object
    return record["offset"], record["offset"] + stride * record["layers"]


def _inside(span: tuple[int, int], runs: list[list[int]]) -> bool:
    offset, end = span
    return any(start <= offset and end <= start + used for _, start, _, used in runs)
