"""A node's directory of the chains it is home to (``core/homes.py``): anchor (or tail) page
digest -> the NodeID that holds the page and its prefix, per tenant, bounded (least recently
used go first), and the node calls that read and write it.

The directory is kept in memory and appended to ``<root>/homes.log`` as it changes, so a
restarted node answers for the chains it was home to at once (a lookup that its homes cannot
answer is a miss: nothing else would find those chains). The log is rewritten from memory
when it holds more than twice the live records; a torn last record (the process died while
appending) is ignored on load.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flatcake_ray.core.homes import anchor_of
from flatcake_ray.core.keys import as_digests, request_digests
from flatcake_ray.errors import ShapeError

log = logging.getLogger(__name__)
MAX_CHAINS = 1 << 20
_HEADER = struct.Struct("<HI")  # tenant name length, owner NodeID
_FIRST_BYTES = 16
FIND_METHODS = frozenset({"lookup", "exists", "probe"})


def check_first(first: object) -> bytes:
    if not isinstance(first, bytes) or len(first) != _FIRST_BYTES:
        raise ShapeError("a chain is named by one page's 16-byte digest")
    return first


def _record(tenant: str, first: bytes, owner: int) -> bytes:
    name = tenant.encode()
    return _HEADER.pack(len(name), owner) + name + first


def _records(raw: bytes) -> list[tuple[str, bytes, int]]:
    out, at = [], 0
    while at + _HEADER.size <= len(raw):
        length, owner = _HEADER.unpack_from(raw, at)
        end = at + _HEADER.size + length + _FIRST_BYTES
        if end > len(raw):
            break  # torn by a crash mid-append
        name = raw[at + _HEADER.size : at + _HEADER.size + length].decode(errors="replace")
        out.append((name, raw[end - _FIRST_BYTES : end], owner))
        at = end
    return out


class HomeDirectory:
    def __init__(self, path: Path | None = None, max_chains: int = MAX_CHAINS) -> None:
        self.max_chains = max_chains
        self.path = path
        self._owners: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._lock = threading.Lock()
        self._logged = 0
        self._log: Any = None
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        if path.exists():
            for tenant, first, owner in _records(path.read_bytes()):
                self._put(tenant, first, owner)
            log.info("%d chain home records read from %s", len(self._owners), path)
        self._rewrite()

    def _put(self, tenant: str, first: bytes, owner: int) -> None:
        self._owners[(tenant, first)] = owner
        self._owners.move_to_end((tenant, first))
        while len(self._owners) > self.max_chains:
            self._owners.popitem(last=False)

    def _rewrite(self) -> None:
        """The log anew from memory (under the lock, or before any caller)."""
        if self.path is None:
            return
        if self._log is not None:
            self._log.close()
        scratch = self.path.with_suffix(".new")
        raw = b"".join(_record(t, f, o) for (t, f), o in self._owners.items())
        scratch.write_bytes(raw)
        os.replace(scratch, self.path)
        self._log = open(self.path, "ab", buffering=0)  # noqa: SIM115 (kept open: appended)
        self._logged = len(self._owners)

    def record(self, tenant: str, first: bytes, owner: int) -> None:
        with self._lock:
            if self._owners.get((tenant, first)) == owner:
                self._owners.move_to_end((tenant, first))
                return
            self._put(tenant, first, owner)
            if self._log is not None:
                self._log.write(_record(tenant, first, owner))
                self._logged += 1
                if self._logged > 2 * len(self._owners) + 1024:
                    self._rewrite()

    def owner(self, tenant: str, first: bytes) -> int | None:
        with self._lock:
            return self._owners.get((tenant, first))

    def drop_tenant(self, tenant: str) -> None:
        with self._lock:
            for key in [key for key in self._owners if key[0] == tenant]:
                del self._owners[key]
            self._rewrite()

    def close(self) -> None:
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None

    def __len__(self) -> int:
        return len(self._owners)


@dataclass(frozen=True)
class Found:
    """A home's answer to ``find``: its own answer to the lookup (a LeaseReply, a Probe or a
    page count) and, when it does not hold the whole request, the owner it recorded for the
    request's anchor (or None)."""

    answer: Any
    owner: int | None


def _hits(answer: Any) -> int:
    return int(answer) if isinstance(answer, int) else int(answer.hits)


class HomeCalls:
    """The StorageNode calls of a chain's home (mixed into ``StorageNode``, which provides
    ``_tenant``, ``homes`` and the lookup methods)."""

    homes: HomeDirectory

    def _tenant(self, secret: object) -> Any:
        raise NotImplementedError

    def record_home(self, secret: object, first: object, owner: object) -> None:
        """This node is a home of page ``first`` (a chain's anchor or tail), which ``owner``
        holds with its prefix."""
        tenant = self._tenant(secret).name
        if not isinstance(owner, int) or isinstance(owner, bool):
            raise ShapeError(f"an owner is a NodeID, not {type(owner).__name__}")
        self.homes.record(tenant, check_first(first), owner)

    def home_of(self, secret: object, first: object) -> int | None:
        """The NodeID recorded for page ``first``, if any."""
        return self.homes.owner(self._tenant(secret).name, check_first(first))

    def find(self, secret: object, method: object, keys: Any, namespace: Any = None) -> Found:
        """``method`` ("lookup" with lease, "exists" or "probe") of ``keys`` here, and when
        this node does not hold them all, the owner it recorded for their anchor: a home
        answers a lookup in one call whether it owns the chain, knows its owner, or knows
        nothing."""
        tenant = self._tenant(secret).name  # a stranger is refused before anything else
        if not isinstance(method, str) or method not in FIND_METHODS:
            raise ShapeError(f"find answers {sorted(FIND_METHODS)}, not {method!r}")
        answer = getattr(self, method)(secret, keys, namespace)
        digests = as_digests(keys)
        if digests is None:
            digests = request_digests(keys, namespace)
        if _hits(answer) == len(digests):
            return Found(answer, None)
        # A part of the request here (a shared first page) does not hide a longer one there.
        return Found(answer, self.homes.owner(tenant, anchor_of(digests)))
