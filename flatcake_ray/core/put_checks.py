"""What a put must be before anything is allocated, evicted or written: a session id the
manifest can hold and give back exactly, a segment the index can address, and a size its
media could ever hold."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from flatcake_ray.core.extents import MediumSpace
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.index import MAX_SEGMENT_PAGES
from flatcake_ray.core.layout import SegmentLayout
from flatcake_ray.core.records import PutHints, SessionId
from flatcake_ray.errors import (
    InvalidSessionError,
    MediumFullError,
    PutTooLargeError,
    SegmentTooLargeError,
    ShapeError,
)

MAX_SESSION_ID_BYTES = 1024
_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1  # the ints msgpack (the manifest) holds


def check_session_id(session_id: object) -> SessionId:
    """``session_id`` as stored: a non-empty str or bytes of at most 1 KiB, or an int that
    fits 64 bits, as its plain type (so it reads back from the manifest exactly); anything
    else is an :class:`InvalidSessionError` (a tuple would come back as a list)."""
    if isinstance(session_id, bool) or not isinstance(session_id, str | int | bytes | np.integer):
        raise InvalidSessionError(
            f"a session id is a str, int or bytes, not {type(session_id).__name__}"
        )
    if isinstance(session_id, int | np.integer):
        value = int(session_id)
        if not _INT64_MIN <= value <= _UINT64_MAX:
            raise InvalidSessionError(f"an int session id must fit 64 bits, got {value}")
        return value
    if isinstance(session_id, str):
        try:
            raw = session_id.encode()
        except UnicodeEncodeError as exc:
            raise InvalidSessionError(f"a str session id must be valid Unicode: {exc}") from None
        plain: SessionId = str.__str__(session_id)
    else:
        raw = plain = bytes(session_id)
    if not raw or len(raw) > MAX_SESSION_ID_BYTES:
        raise InvalidSessionError(
            f"a session id holds 1 to {MAX_SESSION_ID_BYTES} bytes, got {len(raw)}"
        )
    return plain


def check_hints(hints: object) -> None:
    """Hints are a :class:`~flatcake_ray.core.records.PutHints` or None (``hints="fast"``
    was an untyped AttributeError deep in placement)."""
    if hints is not None and not isinstance(hints, PutHints):
        raise ShapeError(f"hints are PutHints or None, not {type(hints).__name__}")


def check_segment_pages(pages: int) -> None:
    """A segment numbers its pages in 24 bits: page 2**24 would alias the next segment's
    page 0 (and pass its checksums), so a put of more pages than that is refused, whether
    or not some of them are stored already."""
    if pages > MAX_SEGMENT_PAGES:
        raise SegmentTooLargeError(
            f"one put may name at most {MAX_SEGMENT_PAGES} pages, got {pages}; "
            "split it into several puts"
        )


def put_refusal(layout: SegmentLayout, tried: Mapping[Medium, MediumSpace]) -> MediumFullError:
    """The error for a put no medium in ``tried`` could hold (raised before any eviction):
    :class:`PutTooLargeError` when it exceeds the largest extent each could ever give,
    :class:`MediumFullError` when what it needs is held by leased or in-flight scopes."""
    what = f"a put of {layout.pages} pages x {layout.layers} layers ({layout.nbytes} bytes)"
    if all(layout.nbytes > space.region_bytes or not space.allocators for space in tried.values()):
        limits = ", ".join(f"{m.name}: {space.region_bytes} bytes" for m, space in tried.items())
        return PutTooLargeError(
            f"{what} is larger than the largest extent its media can ever give ({limits}; "
            "one DRAM arena, one SSD pool file); split it into several puts"
        )
    return MediumFullError(
        f"no room for {what} on {' or '.join(m.name for m in tried)}, and reclaiming every "
        "unreferenced scope would not make room (the rest is leased or being written); "
        "nothing was evicted"
    )
