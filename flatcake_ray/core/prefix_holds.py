"""Shared-prefix holds: a later request does not read from SSD what an earlier one will bring
into HBM.

Why. In an agentic session the next turn often arrives while the previous turn is still
queued or running. Both hold the session's prefix on SSD; without a hold both prefetch it,
and the one that runs second finds it in HBM (the first one's prefill brought it): read,
never delivered (SSD read amplification 1.2-1.5 on the replay's loaded agentic cells).

The rule. Each SSD page (GVA) has at most one *holder*: the oldest request not yet finished
that will read it and bring it into HBM by its prefill. A request that needs a page some
older holder holds is *held*: its prefetch does not start until every holder it waits for
has finished (its prefill ended, or it was cancelled). The caller then looks the request up
again: what is in HBM needs no read, and only what is still on SSD is prefetched. The pages a
request needs that nobody holds are held by it, so a third request may wait for it in turn.

Order. A request only waits for holders registered before it, so the waits form no cycle: a
request that goes back for a second prefetch keeps its place (and its holds) from its first.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

RequestId = Hashable


class PrefixHolds:
    """Holders of SSD pages and the requests held behind them (pure bookkeeping)."""

    def __init__(self) -> None:
        self._holder: dict[int, RequestId] = {}  # SSD GVA -> the request that will bring it
        self._pages: dict[RequestId, list[int]] = {}  # holder -> the GVAs it holds
        self._order: dict[RequestId, int] = {}  # holder -> registration order
        self._waiters: dict[RequestId, set[RequestId]] = {}  # holder -> requests held by it
        self._waits_for: dict[RequestId, set[RequestId]] = {}  # held request -> its holders
        self._next = 0

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._order

    def is_held(self, request_id: RequestId) -> bool:
        return request_id in self._waits_for

    @property
    def held_count(self) -> int:
        return len(self._waits_for)

    def register(self, request_id: RequestId, ssd_gvas: Iterable[int]) -> bool:
        """Record that ``request_id`` will read ``ssd_gvas``; True if it must wait for older
        holders of some of them (it then holds only the rest)."""
        order = self._order.setdefault(request_id, self._next)
        if order == self._next:
            self._next += 1
        holder, mine = self._holder, self._pages.setdefault(request_id, [])
        blockers: set[RequestId] = set()
        for gva in ssd_gvas:
            owner = holder.get(gva)
            if owner is None:
                holder[gva] = request_id
                mine.append(gva)
            elif owner != request_id and self._order[owner] < order:
                blockers.add(owner)
        for owner in blockers:
            self._waiters.setdefault(owner, set()).add(request_id)
        if blockers:
            self._waits_for.setdefault(request_id, set()).update(blockers)
        return bool(blockers)

    def drop(self, request_id: RequestId) -> list[RequestId]:
        """``request_id`` will bring nothing more into HBM (finished or cancelled): forget its
        pages and its own waits; returns the requests no longer held (in submission order)."""
        for owner in self._waits_for.pop(request_id, ()):
            self._waiters[owner].discard(request_id)
        for gva in self._pages.pop(request_id, ()):
            if self._holder.get(gva) == request_id:
                del self._holder[gva]
        self._order.pop(request_id, None)
        released = []
        for waiter in self._waiters.pop(request_id, ()):
            waits = self._waits_for[waiter]
            waits.discard(request_id)
            if not waits:
                del self._waits_for[waiter]
                released.append(waiter)
        released.sort(key=self._order.__getitem__)
        return released
