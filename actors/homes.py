"""A node's directory of the chains it is home to (``core/homes.py``): first-page digest ->
the NodeID that owns the chain, per tenant, bounded (least recently used go first). Kept in
memory only: after a restart a cold lookup falls back to asking every node, once per chain
per client, and the client's location cache takes over.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from flatcake_ray.errors import ShapeError

MAX_CHAINS = 1 << 20


def check_first(first: object) -> bytes:
    if not isinstance(first, bytes) or len(first) != 16:
        raise ShapeError("a chain is named by its first page's 16-byte digest")
    return first


class HomeDirectory:
    def __init__(self, max_chains: int = MAX_CHAINS) -> None:
        self.max_chains = max_chains
        self._owners: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, tenant: str, first: bytes, owner: int) -> None:
        with self._lock:
            self._owners[(tenant, first)] = owner
            self._owners.move_to_end((tenant, first))
            while len(self._owners) > self.max_chains:
                self._owners.popitem(last=False)

    def owner(self, tenant: str, first: bytes) -> int | None:
        with self._lock:
            return self._owners.get((tenant, first))

    def drop_tenant(self, tenant: str) -> None:
        with self._lock:
            for key in [key for key in self._owners if key[0] == tenant]:
                del self._owners[key]

    def __len__(self) -> int:
        return len(self._owners)
