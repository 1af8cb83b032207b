"""Shared-prefix holds: a later request does not read from SSD what an earlier one will bring
into HBM.

Why. In an agentic session the next turn often arrives while the previous turn is still
queued or running. Both hold the session's prefix on SSD; without a hold both prefetch it,
and the one that runs second finds it in HBM (the first one's prefill brought it): read,
never delivered (SSD read amplification 1.2-1.5 on the replay's loaded agentic cells).

The rule. Each stored page has at most one *holder*: the oldest request not yet finished
that will bring it into HBM by its prefill (from DRAM or SSD: a page one request finds as a
DRAM read replica may be on SSD only by the time the next one looks). A request that would
read from SSD a page some older holder holds is *held*: its prefetch does not start until
every holder it waits for has finished (its prefill ended, or it was cancelled). The caller
then looks the request up again: what is in HBM needs no read, and only what is still on SSD
is prefetched. The pages a request brings that nobody holds are held by it, so a third
request may wait for it in turn. Pages are named by the caller (the key digests, say); by
default by their GVAs, which name a page on one medium only.

Order. A request only waits for holders registered before it, so the waits form no cycle: a
request that goes back for a second prefetch keeps its place (and its holds) from its first.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

RequestId = Hashable


class PrefixHolds:
    """Holders of pages and the requests held behind them (pure bookkeeping)."""

    def __init__(self) -> None:
        self._holder: dict[Hashable, RequestId] = {}  # page -> the request that brings it
        self._pages: dict[RequestId, list[Hashable]] = {}  # holder -> the pages it holds
        self._bringers: dict[Hashable, set[RequestId]] = {}  # page -> every request bringing it
        self._brings: dict[RequestId, list[Hashable]] = {}
        self._reads: dict[RequestId, set[Hashable]] = {}
        self._order: dict[RequestId, int] = {}  # registration order
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

    def register(
        self, request_id: RequestId, brings: Iterable[Hashable], reads: Iterable[Hashable]
    ) -> bool:
        """Record that ``request_id`` will bring the pages ``brings`` into HBM, reading
        ``reads`` (some of them) from SSD; True if it must wait for older holders of pages it
        reads. It holds the pages of ``brings`` nobody holds yet."""
        order = self._order.setdefault(request_id, self._next)
        if order == self._next:
            self._next += 1
        holder, mine = self._holder, self._pages.setdefault(request_id, [])
        known = self._brings.setdefault(request_id, [])
        for page in brings:
            bringers = self._bringers.setdefault(page, set())
            if request_id not in bringers:
                bringers.add(request_id)
                known.append(page)
            if holder.setdefault(page, request_id) == request_id:
                mine.append(page)
        self._reads[request_id] = wanted = set(reads)  # a look-up again replaces them
        return self._wait_for_older(request_id, wanted)

    def drop(self, request_id: RequestId) -> list[RequestId]:
        """``request_id`` will bring nothing more into HBM (finished or cancelled): each page
        it held passes to the oldest other request bringing it; returns the requests no
        longer held (in registration order)."""
        for owner in self._waits_for.pop(request_id, ()):
            self._waiters[owner].discard(request_id)
        for page in self._brings.pop(request_id, ()):
            bringers = self._bringers[page]
            bringers.discard(request_id)
            if not bringers:
                del self._bringers[page]
        for page in self._pages.pop(request_id, ()):
            if self._holder.get(page) == request_id:
                self._pass_on(page)
        self._reads.pop(request_id, None)
        self._order.pop(request_id, None)
        released = []
        for waiter in self._waiters.pop(request_id, ()):
            waits = self._waits_for[waiter]
            waits.discard(request_id)
            if not waits and not self._wait_for_older(waiter, self._reads[waiter]):
                del self._waits_for[waiter]
                released.append(waiter)
        released.sort(key=self._order.__getitem__)
        return released

    def _pass_on(self, page: Hashable) -> None:
        bringers = self._bringers.get(page)
        if not bringers:
            del self._holder[page]
            return
        heir = min(bringers, key=self._order.__getitem__)
        self._holder[page] = heir
        self._pages[heir].append(page)

    def _wait_for_older(self, request_id: RequestId, reads: Iterable[Hashable]) -> bool:
        """Hold ``request_id`` behind the older holders of pages it reads; True if any."""
        order, holder = self._order[request_id], self._holder
        blockers = {
            owner
            for page in reads
            if (owner := holder.get(page, request_id)) != request_id and self._order[owner] < order
        }
        for owner in blockers:
            self._waiters.setdefault(owner, set()).add(request_id)
        if blockers:
            self._waits_for.setdefault(request_id, set()).update(blockers)
        return bool(blockers)
