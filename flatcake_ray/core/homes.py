"""The homes of a chain: the nodes that can say where the chain lives, derived from its first
page's digest alone.

Rendezvous hashing (highest random weight) over the live NodeIDs: every client computes the
same ranking for a digest without asking anyone, and a node joining or leaving changes only
the chains whose first or second candidate it was or becomes (about 2/N of them). A put
records its owner at the first :data:`HOME_REPLICAS` candidates, and a lookup asks those
same candidates, so after one node joins (the old first candidate is now second) or leaves
(the old second is now first) one of them still holds the record: a lookup costs the same
few calls at 2 nodes or at 1,000.
"""

from __future__ import annotations

from collections.abc import Iterable
from hashlib import blake2b

HOME_REPLICAS = 2  # candidates that record a chain, and that a lookup asks


def _score(first: bytes, node_id: int) -> bytes:
    return blake2b(first + node_id.to_bytes(8, "little"), digest_size=8).digest()


def home_candidates(first: bytes, node_ids: Iterable[int], count: int = HOME_REPLICAS) -> list[int]:
    """The ``count`` NodeIDs among ``node_ids`` that rank highest for the chain starting at
    ``first``, best first (fewer when there are fewer nodes)."""
    ranked = sorted(node_ids, key=lambda node_id: _score(first, node_id), reverse=True)
    return ranked[:count]


def home_node(first: bytes, node_ids: Iterable[int]) -> int | None:
    """The chain's home: its first candidate (None when there is no node)."""
    best = home_candidates(first, node_ids, 1)
    return best[0] if best else None
