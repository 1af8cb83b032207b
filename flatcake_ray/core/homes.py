"""The home of a chain: the node that can say where the chain lives, derived from its first
page's digest alone.

Rendezvous hashing (highest random weight) over the live NodeIDs: every client computes the
same home for a digest without asking anyone, and a node joining or leaving moves only the
chains whose home it was or becomes. A put whose owner is not the home records the owner
there (one call), so a cold lookup costs the same few calls at 2 nodes or at 100.
"""

from __future__ import annotations

from collections.abc import Iterable
from hashlib import blake2b


def home_node(first: bytes, node_ids: Iterable[int]) -> int | None:
    """The NodeID among ``node_ids`` that is the home of the chain starting at ``first``
    (None when there is no node)."""
    best, best_score = None, b""
    for node_id in node_ids:
        score = blake2b(first + node_id.to_bytes(8, "little"), digest_size=8).digest()
        if best is None or score > best_score:
            best, best_score = node_id, score
    return best
