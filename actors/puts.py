"""A storage node's open layer-wise puts: what clients are writing, and their deadlines.

A client that starts a layer-wise put (``StorageNode.begin_put``) gets an unguessable put id;
its pieces (``write_pages``) and its ``commit_put``/``abort_put`` name it. A put not finished
within ``ttl_s`` of its last piece is aborted by the node (its client is presumed gone), so
abandoned puts never pin their space.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict

from flatcake_ray.errors import StoreWriteError
from flatcake_ray.node.put import PutHandle


class PutTable:
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

    def get(self, put_id: int) -> PutHandle:
        """The open put ``put_id`` (its deadline pushed back); a typed error if unknown."""
        with self._lock:
            held = self._open.pop(put_id, None)
            if held is None:
                raise StoreWriteError(f"no open put {put_id}: unknown, finished or expired")
            self._open[put_id] = (held[0], time.monotonic() + self.ttl_s)
        return held[0]

    def pop(self, put_id: int) -> PutHandle:
        with self._lock:
            held = self._open.pop(put_id, None)
        if held is None:
            raise StoreWriteError(f"no open put {put_id}: unknown, finished or expired")
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
            handle.abort()
        self.expired += len(gone)
        return len(gone)

    def abort_all(self) -> None:
        with self._lock:
            handles = [handle for handle, _ in self._open.values()]
            self._open.clear()
        for handle in handles:
            handle.abort()

    def __len__(self) -> int:
        return len(self._open)
