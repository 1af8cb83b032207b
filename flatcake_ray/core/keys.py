"""Page keys: an engine's page hash (chained prefix hash) inside a namespace (tenant).

The index stores a 128-bit BLAKE2b digest of (namespace, key type, key), never the key itself,
so every page costs the same 16 bytes whatever the engine's hash looks like. The digested bytes
are framed so that two different (namespace, key) pairs never hash the same bytes: the
namespace is length-prefixed (4 bytes, little endian; without it namespace ``"a"`` with key
``"\0sX"`` was namespace ``"a\0s"`` with key ``"X"``), then a type tag keeps ``b"1"``,
``"1"`` and ``1`` apart, then the key runs to the end.

Digests changed with the length prefix (format 2). Digests are persisted only in an SSD
pool's manifest, so a pool written with the old digests cannot be found by the new ones: the
manifest's format version went from 1 to 2 with this change, and a store refuses a version 1
pool with :class:`~flatcake_ray.errors.ManifestError` (see ``node/manifest.py``), never
serving it as misses while holding its space. DRAM pages do not outlive a restart.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

import numpy as np

from flatcake_ray.errors import InvalidKeyError, MixedNamespaceError


def _load_native() -> Any:
    """The batch digests built from ``core/_digests.c`` by pip install (the same bytes), or
    None where it was not compiled: hashlib then hashes one key at a time."""
    try:
        return importlib.import_module("flatcake_ray.core._digests")
    except ImportError:
        return None


_native = _load_native()


def native_module() -> Any:
    """``core/_digests.c`` as built (its digests and the index's probe), or None."""
    return _native


DEFAULT_NAMESPACE = "default"
KeyLike = bytes | str | int

# A digest is two uint64 words. The top bit of ``hi`` is always set, so ``hi == 0`` is free
# for the index's empty and deleted slot markers (127 bits of hash remain).
HI_MARK = np.uint64(1 << 63)
DIGEST_DTYPE = np.dtype([("hi", "<u8"), ("lo", "<u8")])


@dataclass(frozen=True)
class PageKey:
    """A key with its namespace, for callers that mix tenants in one list (then rejected)."""

    namespace: str
    key: KeyLike


def _key_bytes(key: Any) -> bytes:
    if isinstance(key, bool):
        raise InvalidKeyError("a page key may not be a bool")
    if isinstance(key, bytes | bytearray | memoryview):
        raw = bytes(key)
        tag = b"b"
    elif isinstance(key, str):
        raw = _utf8(key, "a page key")
        tag = b"s"
    elif isinstance(key, int | np.integer):
        value = int(key)
        raw = value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
        tag = b"i"
    else:
        raise InvalidKeyError(f"page keys are bytes, str or int, not {type(key).__name__}")
    if tag != b"i" and not raw:
        raise InvalidKeyError("a page key may not be empty")
    return tag + raw


def check_keys(keys: Iterable[KeyLike]) -> None:
    """The rules of :func:`digest_keys` without hashing: raises for any key it would refuse."""
    for key in keys:
        _key_bytes(key)


def check_key_list(keys: object) -> None:
    """A call names its keys in a list, tuple or 1-D array: a generator would be used up by
    the first pass over it (and has no length), a str would be one key per character."""
    if isinstance(keys, str | bytes | bytearray) or not isinstance(keys, Sequence | np.ndarray):
        raise InvalidKeyError(f"keys are a list or tuple, not {type(keys).__name__}")


def split_namespace(keys: Sequence[KeyLike | PageKey], namespace: str | None) -> tuple[str, list]:
    """One namespace for the whole call and the bare keys; mixed namespaces are an error."""
    check_key_list(keys)
    seen: set[str] = set()
    # The types first, at C speed: a loop over a request's 3,421 plain keys took 0.7 ms.
    if not any(issubclass(kind, PageKey) for kind in set(map(type, keys))):
        return _one_namespace(seen, namespace), list(keys)
    bare: list[KeyLike] = []
    for key in keys:
        if isinstance(key, PageKey):
            seen.add(key.namespace)
            bare.append(key.key)
        else:
            bare.append(key)
    return _one_namespace(seen, namespace), bare


def _one_namespace(seen: set[str], namespace: str | None) -> str:
    if namespace is not None:
        seen.add(namespace)
    if len(seen) > 1:
        raise MixedNamespaceError(f"one call may name one namespace, got {sorted(seen)}")
    resolved = seen.pop() if seen else DEFAULT_NAMESPACE
    if not isinstance(resolved, str) or not resolved:
        raise InvalidKeyError("a namespace is a non-empty str")
    return resolved


def _utf8(text: str, what: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidKeyError(f"{what} is not valid Unicode text: {exc}") from None


def check_key(key: Any) -> None:
    """Raise :class:`InvalidKeyError` unless ``key`` is a valid page key (bytes, str or int)."""
    _key_bytes(key)


def namespace_frame(namespace: str) -> bytes:
    """The length-prefixed namespace every digest of ``namespace`` starts from."""
    if not isinstance(namespace, str) or not namespace:
        raise InvalidKeyError("a namespace is a non-empty str")
    raw = _utf8(namespace, "a namespace")
    return len(raw).to_bytes(4, "little") + raw


def request_digests(keys: Sequence[KeyLike | PageKey], namespace: str | None) -> np.ndarray:
    """The digests of one request's keys (one namespace): what a client sends a node, one
    packed array instead of the keys (16 bytes a page, hashed once, by the caller)."""
    # All plain str keys (the common request) name no PageKey: no namespace to split out.
    frame = namespace_frame(DEFAULT_NAMESPACE if namespace is None else namespace)
    raw = _digest_text_keys(frame, keys)
    if raw is not None:
        return _packed(raw)
    resolved, bare = split_namespace(keys, namespace)
    return digest_keys(resolved, bare)


def put_digests(
    keys: Sequence[KeyLike | PageKey] | np.ndarray,
    namespace: str | None,
    parent: KeyLike | PageKey | np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The digests of a put's keys and of the key it continues (``parent``; None without
    one). Keys sent packed (:func:`request_digests`) carry their namespace, and then so
    does the parent: one packed digest (:func:`parent_digest`)."""
    packed = as_digests(keys)
    if packed is None:
        if isinstance(parent, np.ndarray):
            raise InvalidKeyError("a packed parent goes with packed keys")
        extra = [parent] if parent is not None else []
        resolved, bare = split_namespace([*keys, *extra], namespace)
        digests = digest_keys(resolved, bare)
        return digests[: len(keys)], digests[len(keys) :] if parent is not None else None
    if namespace is not None:
        raise InvalidKeyError("packed digests carry their namespace; pass none")
    if parent is None:
        return packed, None
    parent_digest = as_digests(parent)
    if parent_digest is None or len(parent_digest) != 1:
        raise InvalidKeyError("with packed keys the parent is one packed digest")
    return packed, parent_digest


def parent_digest(
    keys: Sequence[KeyLike | PageKey], namespace: str | None, parent: KeyLike | PageKey
) -> np.ndarray:
    """The digest of the key a put continues, in the namespace of the put's keys (one packed
    digest: what a client routes by and sends the owner beside its packed keys)."""
    resolved, bare = split_namespace([*keys, parent], namespace)
    return digest_keys(resolved, bare[-1:])


def as_digests(value: Any) -> np.ndarray | None:
    """``value`` as digests if it is a 1-D DIGEST_DTYPE array (a packed request); None when it
    is something else (keys); InvalidKeyError for an array that no digest function made."""
    if not isinstance(value, np.ndarray) or value.dtype != DIGEST_DTYPE:
        return None
    if value.ndim != 1 or not np.all(value["hi"] & HI_MARK):
        raise InvalidKeyError("packed digests are a 1-D array made by request_digests")
    return value


def digest_keys(namespace: str, keys: Iterable[KeyLike]) -> np.ndarray:
    """An array of DIGEST_DTYPE, one row per key, in order."""
    prefix = namespace_frame(namespace)
    raw = _digest_text_keys(prefix, keys)
    if raw is None:
        raw = b"".join(blake2b(prefix + _key_bytes(key), digest_size=16).digest() for key in keys)
    return _packed(raw)


def _packed(raw: bytes) -> np.ndarray:
    digests = np.frombuffer(raw, dtype=DIGEST_DTYPE).copy()
    digests["hi"] |= HI_MARK
    return digests


def _digest_text_keys(prefix: bytes, keys: Iterable[KeyLike | PageKey]) -> bytes | None:
    """The packed digests when every key is a non-empty str (the common request), hashed
    without the per-key type dispatch of :func:`_key_bytes` (it was half of a 3,421-key
    request's 9 ms here), in one native call when ``core/_digests.c`` is built (a hashlib
    object per key was most of the rest); the same bytes as the general path. None: some key
    is not a plain non-empty str or not encodable, and the general path hashes (or refuses)
    them."""
    if not isinstance(keys, list | tuple):
        return None
    text = prefix + b"s"
    if _native is not None:  # one C call for the whole request (None: some key is not a str)
        return _native.digest_str_keys(text, keys)
    if not all(type(key) is str and key for key in keys):
        return None
    try:
        return b"".join([blake2b(text + key.encode(), digest_size=16).digest() for key in keys])
    except UnicodeEncodeError:
        return None


def key_digests(
    keys: Sequence[KeyLike | PageKey] | np.ndarray, namespace: str | None
) -> np.ndarray:
    """The digests of ``keys``, or ``keys`` themselves when already packed digests (which
    carry their namespace: naming one as well is an :class:`InvalidKeyError`)."""
    packed = as_digests(keys)
    if packed is None:
        return request_digests(keys, namespace)  # type: ignore[arg-type]
    if namespace is not None:
        raise InvalidKeyError("packed digests carry their namespace; pass none")
    return packed
