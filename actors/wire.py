"""The shape checks of what arrives at an actor method: anything a caller can send.

Ray hands an actor whatever a caller pickled, so every argument is checked here (its type, its
length, its bounds) before it reaches the store; a malformed one is a typed error, and nothing
stored changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.keys import as_digests
from flatcake_ray.errors import InvalidKeyError, ReadRangeError, ShapeError

MAX_KEYS = 1 << 20  # pages one call may name
MAX_RANGES = 1 << 20  # ranges one read call may name
MAX_WINDOW_BYTES = 1 << 48  # a stream's total is bounded by its leases, not by a reply


def check_request(keys: Any, namespace: Any, hints: Any = None) -> None:
    """Keys are a list of keys, or packed digests (``core.keys.request_digests``)."""
    if as_digests(keys) is None and not isinstance(keys, list | tuple):
        raise InvalidKeyError(f"keys are a list or packed digests, not {type(keys).__name__}")
    if not 0 < len(keys) <= MAX_KEYS:
        raise ShapeError(f"a call names 1 to {MAX_KEYS} keys, not {len(keys)}")
    if namespace is not None and not isinstance(namespace, str):
        raise InvalidKeyError(f"a namespace is a str, not {type(namespace).__name__}")
    if hints is not None and not isinstance(hints, PutHints):
        raise ShapeError(f"hints are PutHints, not {type(hints).__name__}")


def _int_array(value: Any, what: str) -> np.ndarray:
    if not isinstance(value, np.ndarray | list | tuple):
        raise ReadRangeError(f"{what} are an array of ints, not {type(value).__name__}")
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, UnicodeDecodeError) as exc:  # ragged, or bytes numpy decodes
        raise ReadRangeError(f"{what} are a 1-D array of ints ({exc})") from None
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ReadRangeError(f"{what} are a 1-D array of ints")
    return array.astype(np.int64)


def check_ranges(offsets: Any, lengths: Any, max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Read ranges as int64 arrays: as many offsets as lengths, none negative, the total at
    most ``max_bytes`` (a reply is bounded)."""
    src, sizes = _int_array(offsets, "offsets"), _int_array(lengths, "lengths")
    if len(src) != len(sizes) or not 0 < len(src) <= MAX_RANGES:
        raise ReadRangeError(f"{len(src)} offsets and {len(sizes)} lengths")
    if (src < 0).any() or (sizes <= 0).any():
        raise ReadRangeError("offsets are >= 0 and lengths > 0")
    total = int(sizes.sum())
    if total > max_bytes:
        raise ReadRangeError(f"{total} bytes asked in one call; at most {max_bytes}")
    return src, sizes


def check_windows(
    offsets: Any, lengths: Any, counts: Any, max_window: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """A stream's windows: ``counts[i]`` consecutive ranges each, every window at most
    ``max_window`` bytes (a region of the ship buffer), every range checked as a read's."""
    src, sizes = check_ranges(offsets, lengths, MAX_WINDOW_BYTES)
    per_window = _int_array(counts, "counts")
    if not len(per_window) or (per_window <= 0).any() or int(per_window.sum()) != len(src):
        raise ReadRangeError(
            f"window counts {per_window.tolist()[:8]} do not cover {len(src)} ranges"
        )
    cuts = np.cumsum(per_window)[:-1]
    windows = list(zip(np.split(src, cuts), np.split(sizes, cuts), strict=True))
    biggest = max(int(w[1].sum()) for w in windows)
    if biggest > max_window:
        raise ReadRangeError(f"a window of {biggest} bytes; at most {max_window}")
    return windows


def scope_ids(value: Any) -> set[int]:
    """The scope ids a reader reports bad (anything else in the list is ignored)."""
    if not isinstance(value, list | tuple):
        raise ShapeError(f"bad scopes are a list, not {type(value).__name__}")
    return {s for s in value if isinstance(s, int) and not isinstance(s, bool)}


def lease_ids(value: Any) -> list[int]:
    """Lease ids a reader lets go of without asking for an answer (``lookup``'s
    ``releases``): an int64 array, as the client packs them, or a list of ints."""
    if isinstance(value, np.ndarray) and value.dtype == np.int64 and value.ndim == 1:
        ids = value.tolist()
    elif isinstance(value, list | tuple):
        ids = [i for i in value if isinstance(i, int) and not isinstance(i, bool)]
    else:
        raise ShapeError(f"releases are an int64 array or a list, not {type(value).__name__}")
    if len(ids) > MAX_KEYS:
        raise ShapeError(f"a call releases at most {MAX_KEYS} leases, not {len(ids)}")
    return ids
