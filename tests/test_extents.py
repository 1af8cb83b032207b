import itertools
import threading

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flatcake_ray.core.extents import ExtentAllocator, MediumSpace, ScopeRuns, hand_over_vacated


def test_first_fit_and_merge_on_free():
    alloc = ExtentAllocator(0, 16 * 4096)
    a, b, c = (alloc.allocate(4096 * n) for n in (2, 3, 4))
    assert (a, b, c) == (0, 8192, 20480)
    alloc.free(b, 3 * 4096)
    alloc.free(a, 2 * 4096)
    assert alloc.allocate(5 * 4096) == 0  # the two holes merged
    assert alloc.allocate(100 * 4096) is None


def test_scope_runs_stay_contiguous_and_grow_in_place():
    space = MediumSpace(region_bytes=1 << 20, regions=2, min_run=64 << 10)
    scope = ScopeRuns()
    offsets = [space.place(scope, 16 << 10) for _ in range(8)]
    assert offsets == [offsets[0] + i * (16 << 10) for i in range(8)]
    assert len(scope.runs) == 1  # grown in place, not chained


def test_small_scopes_do_not_take_a_file_each():
    space = MediumSpace(region_bytes=8 << 20, regions=2, min_run=64 << 10)
    scopes = [ScopeRuns() for _ in range(20)]
    for scope in scopes:
        assert space.place(scope, 8 << 10) is not None
    assert sum(s.reserved_bytes for s in scopes) == 20 * (64 << 10)


def test_chains_a_new_run_when_blocked():
    space = MediumSpace(region_bytes=1 << 20, regions=1, min_run=64 << 10)
    first, blocker = ScopeRuns(), ScopeRuns()
    space.place(first, 64 << 10)  # reserves a 128 KiB run, half used
    space.place(blocker, 64 << 10)  # sits right after it
    assert space.place(first, 128 << 10) is not None
    assert len(first.runs) == 2 and first.runs[1].length == 2 * first.runs[0].length
    assert space.release(first) == (128 + 256) << 10
    assert space.free_bytes == (1 << 20) - blocker.reserved_bytes


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40)), max_size=60))
def test_runs_never_overlap(steps):
    space = MediumSpace(region_bytes=1 << 20, regions=2, min_run=16 << 10)
    scopes = [ScopeRuns() for _ in range(6)]
    for scope_index, pages in steps:
        if pages > 35:
            space.release(scopes[scope_index])
        else:
            space.place(scopes[scope_index], pages * 4096)
    runs = sorted((r.start, r.length) for s in scopes for r in s.runs)
    for (a, la), (b, _) in itertools.pairwise(runs):
        assert a + la <= b
    assert all(r.used <= r.length for s in scopes for r in s.runs)
    assert space.free_bytes + sum(s.reserved_bytes for s in scopes) == space.capacity


def test_owned_regions_grow_and_shrink_a_region_at_a_time_without_moving_a_run():
    space = MediumSpace(
        region_bytes=256 << 10, regions=4, min_run=4096, total=900 << 10, owned=True
    )
    assert [a.capacity for a in space.allocators] == [256 << 10] * 3 + [132 << 10]
    alpha = [ScopeRuns(owner="alpha") for _ in range(3)]
    beta = ScopeRuns(owner="beta")
    assert space.place(alpha[0], 200 << 10, reserve_ahead=False) is not None
    assert space.place(beta, 100 << 10, reserve_ahead=False) is not None
    assert space.regions_of("alpha") == [0] and space.regions_of("beta") == [1]
    placed = space.place(alpha[1], 200 << 10, reserve_ahead=False)  # no room in its own: grows
    assert placed is not None and space.regions_of("alpha") == [0, 2]
    beta_runs = [(run.start, run.length) for run in beta.runs]
    # Another's region is never open, even with room in it: the last region is too short.
    assert space.place(alpha[2], 200 << 10, reserve_ahead=False) is None
    assert space.largest_free_to("alpha") == 132 << 10 and space.largest_free_to("beta") > 150 << 10
    space.release(alpha[0])  # region 0 emptied: back to no one, without touching any run
    assert space.regions_of("alpha") == [2] and space.owners[0] is None
    assert space.place(beta, 200 << 10, reserve_ahead=False) == 0  # beta grows into it
    assert [(run.start, run.length) for run in beta.runs][:1] == beta_runs
    assert space.regions_of("beta") == [0, 1]


def test_an_unowned_medium_keeps_every_region_open_to_every_scope():
    space = MediumSpace(region_bytes=64 << 10, regions=2, min_run=4096)
    first, second = ScopeRuns(owner="a"), ScopeRuns(owner="b")
    assert space.place(first, 48 << 10, reserve_ahead=False) == 0
    assert space.place(second, 16 << 10, reserve_ahead=False) is not None
    assert space.regions_of("a") == space.regions_of("b") == [0, 1]


def test_a_region_that_goes_to_another_owner_is_handed_over_first():
    space = MediumSpace(1 << 20, 3, 4096, owned=True)
    handed: list[int] = []
    space.on_handover = handed.append
    held_by_alpha = set()
    for _ in range(2):  # alpha takes a region, empties it, takes one again (never handed over)
        alpha = ScopeRuns(owner="alpha")
        held_by_alpha.add(space.region_of(space.place(alpha, 4096)))
        space.release(alpha)
    assert handed == [] and space.owners == [None] * 3
    beta = [ScopeRuns(owner="beta") for _ in range(3)]
    for scope in beta:  # a whole region each: beta takes all three
        space.place(scope, 1 << 20, reserve_ahead=False)
    assert sorted(handed) == sorted(held_by_alpha)  # alpha's, first; never one nobody held

    def refuse(region: int) -> None:
        raise OSError("no memory for a fresh file")

    for scope in beta:
        space.release(scope)
    space.on_handover = refuse
    gamma = ScopeRuns(owner="gamma")
    with pytest.raises(OSError):  # a region that cannot change hands is not taken
        space.place(gamma, 1 << 20, reserve_ahead=False)
    assert space.owners == [None] * 3 and space.free_bytes == space.capacity
    space.on_handover = handed.append
    handed.clear()
    assert space.place(gamma, 1 << 20, reserve_ahead=False) is not None
    assert handed == [space.region_of(gamma.runs[0].start)]  # handed over now, once


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 2), st.integers(1, 80)), max_size=80)
)
@example([("a", 0, 1), ("a", 0, 67), ("a", 0, 1)])  # removed, then its name comes back
@example([("a", 0, 1), ("b", 0, 1), ("a", 0, 67), ("a", 1, 1), ("c", 0, 71), ("b", 1, 1)])
@example([("a", 0, 1), ("a", 0, 71), ("b", 0, 65), ("b", 0, 1), ("a", 0, 1)])  # ahead of time
def test_no_region_reaches_another_owner_without_a_handover(steps):
    """Whatever the owners do (place, release, be forgotten, have vacated regions handed
    over ahead of time), a run placed in a region whose last run was another owner's (or a
    forgotten owner's) comes after a handover of that region; a region is handed over ahead
    of time only while it is empty; no two owners ever have runs in one region."""
    space = MediumSpace(region_bytes=256 << 10, regions=3, min_run=4096, owned=True)
    handed: list[int] = []
    space.on_handover = handed.append
    scopes = {(o, i): ScopeRuns(owner=o) for o in "abc" for i in range(3)}
    last: dict[int, str] = {}  # region -> whose run was placed there last ("gone": forgotten)
    clean: set[int] = set()  # regions handed over since their last run was placed
    dead: list[ScopeRuns] = []  # a forgotten owner's scopes: runs still held, never extended
    for owner, index, pages in steps:
        scope = scopes[(owner, index)]
        if pages > 70:
            space.release(scope)
            if dead:
                space.release(dead.pop(0))  # given back later, as an aborted put's slots
            continue
        if 63 < pages <= 66:  # the store's tick: vacated regions handed over now
            before = len(handed)
            hand_over_vacated(space, threading.Lock(), handed.append)
            ahead = set(handed[before:])
            live = [*scopes.values(), *dead]
            assert not ahead & {r.allocator for s in live for r in s.runs}  # empty ones only
            clean |= ahead
            continue
        if pages > 66:  # removed: its scopes go dead, whoever takes its name is another
            for i in range(3):
                dead.append(scopes[(owner, i)])
                scopes[(owner, i)] = ScopeRuns(owner=owner)
            space.forget(owner)
            last = {r: ("gone" if o == owner else o) for r, o in last.items()}
            continue
        before = len(handed)
        placed = space.place(scope, pages * 4096)
        clean |= set(handed[before:])
        if placed is None:
            continue
        region = space.region_of(placed)
        if last.get(region, owner) != owner:
            assert region in clean  # handed over since another owner's last run there
        last[region] = owner
        clean.discard(region)
        others = [s for s in scopes.values() if s.owner != owner] + dead
        assert region not in {r.allocator for s in others for r in s.runs}


def test_a_vacated_region_handed_over_ahead_is_no_ones_meanwhile_and_free_after():
    space = MediumSpace(1 << 20, 2, 4096, owned=True)
    handed: list[int] = []
    space.on_handover = handed.append
    alpha = ScopeRuns(owner="alpha")
    region = space.region_of(space.place(alpha, 1 << 20, reserve_ahead=False))
    assert space.vacated() == []  # in use
    space.release(alpha)
    assert space.vacated() == [region]
    space.begin_handover(region)
    beta = [ScopeRuns(owner=name) for name in ("beta", "alpha")]
    assert space.place(beta[0], 1 << 20, reserve_ahead=False) is not None  # the other region
    assert space.place(beta[1], 1 << 20, reserve_ahead=False) is None  # not even its last owner
    with pytest.raises(ValueError):
        space.begin_handover(region)  # already being handed over
    space.end_handover(region, done=True)
    assert space.vacated() == []
    gamma = ScopeRuns(owner="gamma")
    assert space.region_of(space.place(gamma, 1 << 20, reserve_ahead=False)) == region
    assert handed == []  # taken for free: its handover was paid ahead of time
    space.release(gamma)
    space.begin_handover(region)
    space.end_handover(region, done=False)  # the work failed: the next other taker pays it
    delta = ScopeRuns(owner="delta")
    assert space.place(delta, 1 << 20, reserve_ahead=False) is not None and handed == [region]
