"""Space allocation: aligned extents inside one address range, and scopes' runs on a medium.

The live store and the replay model share this code; the replay model simply never writes
bytes into what it allocates.

- :class:`ExtentAllocator`: first-fit over a sorted free list, neighbours merged on free.
  One per DRAM arena, one per SSD pool file (a run never crosses a file boundary, so every
  run is one single-extent file range).
- :class:`MediumSpace`: the allocators of one medium, plus the rule that keeps a scope's
  segments contiguous without wasting a large file on a small chat scope: a new scope
  reserves a run of ``max(2 x first segment, min_run)`` (exactly the segment when the
  caller expects no continuation); later segments fill the run, then grow it in place if
  the bytes after it are free, else chain a new run of ``max(2 x segment, min_run)``.

A medium may be *owned* (``owned=True``: the DRAM arena of a service, split into chunks, one
region each): a region then belongs to at most one owner (a tenant) at a time, and a scope's
runs are taken only from its owner's regions or from a free one, which becomes its owner's.
A region whose last run is freed belongs to no one again. So an owner's share grows a
region at a time and shrinks a region at a time, and no byte is ever copied to do either:
a region changes hands only when it is empty. Which owner gets how much is still decided by
quotas and reclamation (``core/allocation.py``), not by a fixed partition. When a region goes
to an owner other than the one that held it last, ``on_handover`` hears of it before any run
there is handed out: the live store gives the region fresh memory then (a new memfd, so a
former owner's mapping reaches nothing of the next owner's, ``media/arena.py``); the replay
model, which has no memory, leaves it unset. Since that work is paid under the caller's lock
by whoever takes the region, the store also does it ahead of time for regions left empty
(``vacated``, ``begin_handover``, ``end_handover``), off its lock: a region being handed over
is no one's to take.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from flatcake_ray.core.runs import align_up

_GONE = "\0gone"  # the last owner of a region whose owner was forgotten: no owner's name
_RENEWING = "\0renewing"  # the holder of a region handed over ahead of time: no one may take it


class ExtentAllocator:
    """Aligned first-fit allocation over ``[base, base + capacity)``."""

    def __init__(self, base: int, capacity: int) -> None:
        self.base = base
        self.capacity = capacity
        self._starts: list[int] = [base] if capacity else []
        self._lengths: list[int] = [capacity] if capacity else []
        self.free_bytes = capacity

    def allocate(self, nbytes: int) -> int | None:
        """Start of a free run of ``nbytes`` (a multiple of ALIGN), or None when none fits."""
        for i, length in enumerate(self._lengths):
            if length >= nbytes:
                start = self._starts[i]
                self._take(i, start, nbytes)
                return start
        return None

    def extend(self, start: int, length: int, extra: int) -> bool:
        """Grow the run ``[start, start+length)`` by ``extra`` bytes in place, if free."""
        end = start + length
        i = bisect.bisect_left(self._starts, end)
        if i < len(self._starts) and self._starts[i] == end and self._lengths[i] >= extra:
            self._take(i, end, extra)
            return True
        return False

    def _take(self, i: int, start: int, nbytes: int) -> None:
        assert self._starts[i] == start
        if self._lengths[i] == nbytes:
            del self._starts[i], self._lengths[i]
        else:
            self._starts[i] += nbytes
            self._lengths[i] -= nbytes
        self.free_bytes -= nbytes

    def reserve(self, start: int, nbytes: int) -> None:
        """Mark a known run as used (a restarted store replaying its manifest)."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or start + nbytes > self._starts[i] + self._lengths[i]:
            raise ValueError(f"run {start}+{nbytes} is not free")
        head = start - self._starts[i]
        tail = self._starts[i] + self._lengths[i] - start - nbytes
        del self._starts[i], self._lengths[i]
        for offset, size in ((start + nbytes, tail), (start - head, head)):
            if size:
                self._starts.insert(i, offset)
                self._lengths.insert(i, size)
        self.free_bytes -= nbytes

    def free(self, start: int, nbytes: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._lengths.insert(i, nbytes)
        self.free_bytes += nbytes
        if i + 1 < len(self._starts) and start + nbytes == self._starts[i + 1]:
            self._lengths[i] += self._lengths.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
            self._lengths[i - 1] += self._lengths.pop(i)
            self._starts.pop(i)

    @property
    def largest_free(self) -> int:
        return max(self._lengths, default=0)

    def free_extents(self) -> list[tuple[int, int]]:
        """(start, length) of every free extent, in address order."""
        return list(zip(self._starts, self._lengths, strict=True))


@dataclass
class Run:
    """A contiguous reservation of a scope inside one allocator."""

    allocator: int
    start: int
    length: int
    used: int = 0

    @property
    def room(self) -> int:
        return self.length - self.used


@dataclass
class ScopeRuns:
    """The runs a scope holds on its medium; the last one is being filled. ``owner``: whose
    regions they come from, on an owned medium (see :class:`MediumSpace`)."""

    runs: list[Run] = field(default_factory=list)
    owner: str | None = None

    @property
    def reserved_bytes(self) -> int:
        return sum(run.length for run in self.runs)

    @property
    def used_bytes(self) -> int:
        return sum(run.used for run in self.runs)


class MediumSpace:
    """All allocators of one medium, laid end to end in one medium-local offset space."""

    def __init__(
        self,
        region_bytes: int,
        regions: int,
        min_run: int,
        *,
        total: int | None = None,
        owned: bool = False,
    ) -> None:
        """``regions`` of ``region_bytes`` each, the last one cut short at ``total`` bytes
        when given; ``owned``: each region belongs to at most one owner at a time."""
        self.region_bytes = region_bytes
        total = region_bytes * regions if total is None else total
        self.allocators = [
            ExtentAllocator(i * region_bytes, min(region_bytes, total - i * region_bytes))
            for i in range(regions)
        ]
        self.min_run = min_run
        self.owned = owned
        self.owners: list[str | None] = [None] * regions
        self._last_owners: list[str | None] = [None] * regions
        self.on_handover: Callable[[int], None] | None = None
        self._next_region = 0  # new scopes rotate over regions (files, hence drives)

    @property
    def capacity(self) -> int:
        return sum(a.capacity for a in self.allocators)

    def regions_of(self, owner: str | None) -> list[int]:
        """The regions ``owner`` may read and write: its own, or every one when unowned."""
        if not self.owned:
            return list(range(len(self.allocators)))
        return [region for region, holder in enumerate(self.owners) if holder == owner]

    def _open_to(self, region: int, owner: str | None) -> bool:
        return not self.owned or self.owners[region] in (None, owner)

    def _hold(self, region: int, owner: str | None) -> None:
        """``owner`` holds ``region`` from now; one that another owner held last changes hands
        first (``on_handover``; if that fails the region stays no one's)."""
        if not self.owned or self.owners[region] == owner:
            return
        former, self._last_owners[region] = self._last_owners[region], owner
        if former is not None and former != owner and self.on_handover is not None:
            try:
                self.on_handover(region)
            except BaseException:
                self._last_owners[region] = former
                raise
        self.owners[region] = owner

    def forget(self, owner: str) -> None:
        """``owner`` is gone (a removed tenant): a region it held last changes hands when
        anyone takes it next, one re-added under the same name included (its clients are not
        those of the one removed: a tenant's secret is rotated so). A region it still has
        runs in (being given back) is no one's to take until they are."""
        self._last_owners = [_GONE if last == owner else last for last in self._last_owners]
        self.owners = [_GONE if holder == owner else holder for holder in self.owners]

    def vacated(self) -> list[int]:
        """Empty regions that someone held last: the next other owner to take one would pay
        its handover (``on_handover``) then, under its caller's lock. Handed over ahead of
        time (``begin_handover``, the work, ``end_handover``), they are taken for free."""
        if not self.owned:
            return []
        return [
            region
            for region, (holder, last) in enumerate(
                zip(self.owners, self._last_owners, strict=True)
            )
            if holder is None and last is not None and self._empty(region)
        ]

    def begin_handover(self, region: int) -> None:
        """``region`` (one of :meth:`vacated`) is no one's to take until ``end_handover``."""
        if self.owners[region] is not None or not self._empty(region):
            raise ValueError(f"region {region} is held or in use")
        self.owners[region] = _RENEWING

    def end_handover(self, region: int, *, done: bool) -> None:
        """The handover of ``region`` ended; ``done``: whoever takes it next pays none."""
        if self.owners[region] != _RENEWING:
            raise ValueError(f"region {region} is not being handed over")
        self.owners[region] = None
        if done:
            self._last_owners[region] = None

    def _empty(self, region: int) -> bool:
        allocator = self.allocators[region]
        return allocator.free_bytes == allocator.capacity

    def _settle(self, region: int) -> None:
        """An owned region with nothing left in it belongs to no one again (shrinking)."""
        if self.owned and self._empty(region):
            self.owners[region] = None

    @property
    def free_bytes(self) -> int:
        return sum(a.free_bytes for a in self.allocators)

    @property
    def used_fraction(self) -> float:
        return 1.0 - self.free_bytes / self.capacity if self.capacity else 1.0

    def region_of(self, offset: int) -> int:
        return offset // self.region_bytes

    def place(self, scope: ScopeRuns, nbytes: int, *, reserve_ahead: bool = True) -> int | None:
        """Medium offset for a new segment of ``nbytes`` appended to ``scope``, or None.

        ``reserve_ahead=False`` takes exactly what the segment needs (DRAM read replicas:
        they gain nothing from contiguity, and space held ahead would be space they take
        from other replicas)."""
        if scope.runs:
            last = scope.runs[-1]
            if last.room < nbytes and self.allocators[last.allocator].extend(
                last.start, last.length, align_up(nbytes - last.room)
            ):
                last.length += align_up(nbytes - last.room)
            if last.room >= nbytes:
                offset = last.start + last.used
                last.used += nbytes
                return offset
        # Room ahead for about one more segment like this one. (Twice the last run, as this
        # once was, held a whole first turn's size ahead for a chat's small second turn:
        # 106 GiB of 451 GiB reserved in the Mooncake replay were never written.)
        wants = (max(2 * nbytes, self.min_run), nbytes) if reserve_ahead else (nbytes,)
        for want in wants:
            run = self._new_run(min(align_up(want), self.region_bytes), scope.owner)
            if run is not None and run.length >= nbytes:
                run.used = nbytes
                scope.runs.append(run)
                return run.start
            if run is not None:
                self.allocators[run.allocator].free(run.start, run.length)
                self._settle(run.allocator)
        return None

    def _new_run(self, nbytes: int, owner: str | None) -> Run | None:
        """A run in one of ``owner``'s regions, else in a free region it then takes (so an
        owner fills what it holds before it grows)."""
        count = len(self.allocators)
        order = [(self._next_region + step) % count for step in range(count)]
        if self.owned:
            order.sort(key=lambda region: self.owners[region] != owner)
        for region in order:
            if not self._open_to(region, owner):
                continue
            start = self.allocators[region].allocate(nbytes)
            if start is not None:
                try:
                    self._hold(region, owner)
                except BaseException:
                    self.allocators[region].free(start, nbytes)
                    raise
                self._next_region = (region + 1) % count
                return Run(region, start, nbytes)
        return None

    def largest_free_to(self, owner: str | None) -> int:
        """The largest free extent ``owner`` may take (its regions' and free regions')."""
        return max(
            (a.largest_free for r, a in enumerate(self.allocators) if self._open_to(r, owner)),
            default=0,
        )

    def largest_obtainable(self, freeable: Iterable[ScopeRuns], growing: ScopeRuns) -> int:
        """The most bytes one new segment of ``growing`` could get if every scope in
        ``freeable`` (``growing``'s owner's) were freed: a new run in a region open to its
        owner, or the room left in ``growing``'s last run plus the free bytes right after
        it. No state changes."""
        extents: list[list[tuple[int, int]]] = [a.free_extents() for a in self.allocators]
        for runs in freeable:
            for run in runs.runs:
                extents[run.allocator].append((run.start, run.length))
        merged = [  # another owner's regions stay its own whatever is freed here
            dict(_merge(region)) if self._open_to(r, growing.owner) else {}
            for r, region in enumerate(extents)
        ]
        best = max((max(region.values(), default=0) for region in merged), default=0)
        if growing.runs:  # a run never crosses its region, so only its own region can extend it
            last = growing.runs[-1]
            after = merged[last.allocator].get(last.start + last.length, 0)
            best = max(best, last.room + after)
        return best

    def release(self, scope: ScopeRuns) -> int:
        """Free every run of a scope at once; returns the bytes freed. An owned region left
        empty goes back to no one."""
        freed = 0
        for run in scope.runs:
            self.allocators[run.allocator].free(run.start, run.length)
            self._settle(run.allocator)
            freed += run.length
        scope.runs.clear()
        return freed

    def reserve(self, scope: ScopeRuns, start: int, length: int, used: int) -> None:
        region = self.region_of(start)
        if not self._open_to(region, scope.owner):
            raise ValueError(f"run {start}+{length} is in a region another owner holds")
        self._hold(region, scope.owner)
        self.allocators[region].reserve(start, length)
        scope.runs.append(Run(region, start, length, used))


def hand_over_vacated(
    space: MediumSpace, lock: AbstractContextManager[object], hand_over: Callable[[int], None]
) -> int:
    """Hand over every vacated region of ``space`` now (``hand_over(region)``: the live
    store's fresh file), the work outside ``lock``, which guards ``space``; returns how many
    were. One whose handover raised stays vacated (its next taker pays it) and the first
    error is raised once every other has ended."""
    with lock:
        regions = space.vacated()
        for region in regions:
            space.begin_handover(region)
    done, errors = 0, []
    for region in regions:
        ok = False
        try:
            hand_over(region)
            ok = True
            done += 1
        except Exception as exc:  # raised below, after the other regions
            errors.append(exc)
        finally:
            with lock:
                space.end_handover(region, done=ok)
    if errors:
        raise errors[0]
    return done


def _merge(extents: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Touching or overlapping (start, length) extents joined, in address order."""
    joined: list[tuple[int, int]] = []
    for start, length in sorted(extents):
        if joined and joined[-1][0] + joined[-1][1] >= start:
            head, size = joined[-1]
            joined[-1] = (head, max(size, start + length - head))
        else:
            joined.append((start, length))
    return joined
