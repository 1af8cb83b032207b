"""A store's open puts: what writers are writing, and their deadlines.

Every ``begin_put`` of a :class:`~flatcake_ray.node.store.FlatCakeStore` is registered here
under an unguessable id (a storage node hands that id to the Ray client, whose pieces and
``commit_put``/``abort_put`` name it). A put not finished within ``ttl_s`` of its last write
is aborted (its writer is presumed gone: a crashed client, a handle dropped without
``commit`` or ``abort``), so abandoned puts never pin their space. Expiry runs on every
``begin_put`` and lease of the store and on a storage node's report loop.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar

from flatcake_ray.errors import StoreWriteError


class OpenPut(Protocol):
    """What the table needs of a put it holds (:class:`~flatcake_ray.node.put.PutHandle`)."""

    @property
    def tenant(self) -> str: ...

    def abort(self) -> None: ...


PutHandle = TypeVar("PutHandle", bound=OpenPut)


class PutTable(Generic[PutHandle]):
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._open: OrderedDict[int, tuple[PutHandle, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.expired = 0

    def add(self, handle: PutHandle) -> int:
        put_id = secrets.randbits(63)
        with self._lock:
            self._open[put_id] = (handle, time.monotonic() + self.ttl_s)
        return put_id

    def open_of(self, tenant: str) -> int:
        """How many puts ``tenant`` has open."""
        with self._lock:
            return sum(1 for handle, _ in self._open.values() if handle.tenant == tenant)

    def touch(self, put_id: int) -> None:
        """The writer is alive: push the put's deadline back."""
        with self._lock:
            held = self._open.pop(put_id, None)
            if held is not None:
                self._open[put_id] = (held[0], time.monotonic() + self.ttl_s)

    def forget(self, put_id: int) -> None:
        """The put finished (committed or aborted): nothing left to expire."""
        with self._lock:
            self._open.pop(put_id, None)

    def get(self, put_id: object, tenant: str | None = None) -> PutHandle:
        """The open put ``put_id`` (its deadline pushed back); a typed error if unknown, or
        (``tenant`` given) another tenant's: the same error, so ids cannot be probed."""
        with self._lock:
            held = self._open.get(put_id) if isinstance(put_id, int) else None
            if (
                held is None
                or not isinstance(put_id, int)
                or (tenant is not None and held[0].tenant != tenant)
            ):
                raise StoreWriteError(f"no open put {put_id!r}: unknown, finished or expired")
            del self._open[put_id]
            self._open[put_id] = (held[0], time.monotonic() + self.ttl_s)
        return held[0]

    def expire(self, now: float) -> int:
        """Abort every put past its deadline; returns how many."""
        gone = []
        with self._lock:
            while self._open:
                put_id, (handle, deadline) = next(iter(self._open.items()))
                if deadline >= now:
                    break
                del self._open[put_id]
                gone.append(handle)
        for handle in gone:
            handle.abort()  # from the writer's side it is now done: later writes are refused
        self.expired += len(gone)
        return len(gone)

    def abort_all(self) -> None:
        self.abort_tenant(None)

    def abort_tenant(self, tenant: str | None) -> None:
        """Abort the open puts of ``tenant`` (None: every put)."""
        with self._lock:
            ids = [i for i, (h, _) in self._open.items() if tenant in (None, h.tenant)]
            handles = [self._open.pop(i)[0] for i in ids]
        for handle in handles:
            handle.abort()

    def __len__(self) -> int:
        return len(self._open)
