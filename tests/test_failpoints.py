"""Failpoints: armed from tests, no-ops otherwise, thread-safe, disarmed by the fixture."""

import threading

import pytest

from flatcake_ray.errors import ConfigError
from flatcake_ray.failpoints import arm_from_spec, failpoint


class Boom(Exception):
    pass


def hits(name: str, times: int) -> int:
    """How many of ``times`` hits of ``name`` raised Boom."""
    fired = 0
    for _ in range(times):
        try:
            failpoint(name)
        except Boom:
            fired += 1
    return fired


def test_unarmed_points_do_nothing(failpoints):
    failpoint("nowhere", anything=1)
    assert failpoints.armed() == {}


def test_once_n_times_always_and_after_skipping(failpoints):
    failpoints.arm("once", raises=Boom)
    failpoints.arm("thrice", raises=Boom("three"), times=3)
    failpoints.arm("always", raises=Boom, times=None)
    failpoints.arm("later", raises=Boom, times=2, skip=5)
    assert [hits(n, 10) for n in ("once", "thrice", "always", "later")] == [1, 3, 10, 2]
    assert failpoints.armed()["later"].hits == 10 and failpoints.armed()["later"].fired == 2


def test_a_called_action_gets_the_context(failpoints):
    seen = []
    failpoints.arm("with.context", call=lambda **context: seen.append(context), times=None)
    failpoint("with.context", record={"t": "seg"})
    assert seen == [{"record": {"t": "seg"}}]
    failpoints.disarm("with.context")
    failpoint("with.context", record=None)
    assert len(seen) == 1


def test_arming_is_checked(failpoints):
    with pytest.raises(TypeError):
        failpoints.arm("x")
    with pytest.raises(TypeError):
        failpoints.arm("x", raises=Boom, call=print)
    with pytest.raises(ValueError):
        failpoints.arm("x", raises=Boom, times=0)


def test_concurrent_hits_fire_exactly_the_armed_count(failpoints):
    failpoints.arm("shared", raises=Boom, times=25)
    fired = []

    def worker() -> None:
        fired.append(hits("shared", 200))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(fired) == 25 and failpoints.armed()["shared"].hits == 1600


def test_arming_from_a_spec_as_other_processes_do(failpoints):
    points = arm_from_spec("a.b=oserror*2; c=enospc@1 ;d=sleep:0")
    assert [p.name for p in points] == ["a.b", "c", "d"]
    with pytest.raises(OSError, match="Input/output"):
        failpoint("a.b")
    failpoint("c")  # skipped once
    with pytest.raises(OSError, match="No space left"):
        failpoint("c")
    failpoint("d")
    for bad in ("nothing", "x=explode", "x=oserror*two"):
        with pytest.raises(ConfigError):
            arm_from_spec(bad)


def test_the_fixture_disarmed_the_previous_tests_points(failpoints):
    assert failpoints.armed() == {}
