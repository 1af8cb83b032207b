"""The homes of a chain: the nodes that can say where the chain lives, derived from one page's
digest alone: the chain's *anchor*, its page at depth :data:`HOME_DEPTH` (its last page when
it is shorter).

Why not the first page: chains that start with the same page (a system prompt) would all
have the same homes, one hot pair of nodes at any cluster size, and one record there that
the last writer overwrites. The anchor is the first page where conversations differ when
their shared start is shorter than ``HOME_DEPTH`` pages, so their homes spread. The price,
when the client's location cache does not know the anchor: a request that shares fewer than
``HOME_DEPTH`` pages with every stored chain (a new prompt whose only cached page is the
shared first one; a request that extends a chain stored as a single page; a one-page
request of a longer chain's first page) misses those pages, in the same 2 calls, unless a
home it asks holds them itself.
A home record says "this page, and the prefix before it, is on that node" (keys name their
prefix), so a record of any page is true whichever request reads it.

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
from typing import Any

HOME_REPLICAS = 2  # candidates that record a chain, and that a lookup asks
HOME_DEPTH = 2  # a chain is named by its page at this depth (1: its first page)


def anchor_index(pages: int) -> int:
    """The page that names a request (or a chain's first put) of ``pages`` pages."""
    return min(pages, HOME_DEPTH) - 1


def anchor_of(digests: Any) -> bytes:
    """The anchor's digest (16 bytes) of a request's digests (one row per page)."""
    at = anchor_index(len(digests))
    return bytes(digests[at : at + 1].tobytes())


def recorded_pages(pages: int, continues: bool) -> list[int]:
    """Which of a put's ``pages`` pages its homes record. A chain's first put: its anchor.
    A continuation (a put with a parent) does not know its position in the chain, so it
    records its first ``HOME_DEPTH - 1`` pages: the chain's anchor is among them when the
    chain's first put was shorter than ``HOME_DEPTH``. Both: the last page, where the next
    continuation finds its parent (a one-page request: its anchor is that page)."""
    picked = set(range(min(pages, HOME_DEPTH - 1))) if continues else {anchor_index(pages)}
    if continues or pages > 1:
        picked.add(pages - 1)
    return sorted(picked)


def _score(first: bytes, node_id: int) -> bytes:
    return blake2b(first + node_id.to_bytes(8, "little"), digest_size=8).digest()


def home_candidates(first: bytes, node_ids: Iterable[int], count: int = HOME_REPLICAS) -> list[int]:
    """The ``count`` NodeIDs among ``node_ids`` that rank highest for the chain anchored at
    ``first`` (:func:`anchor_of`), best first (fewer when there are fewer nodes)."""
    ranked = sorted(node_ids, key=lambda node_id: _score(first, node_id), reverse=True)
    return ranked[:count]


def home_node(first: bytes, node_ids: Iterable[int]) -> int | None:
    """The chain's home: its first candidate (None when there is no node)."""
    best = home_candidates(first, node_ids, 1)
    return best[0] if best else None
