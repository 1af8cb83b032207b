"""Draining a storage node, through the coordinator as a plain class (no Ray) and the stored
form of the drained set. The service end to end (CLI, clients, a coordinator restart) is in
test_service.py."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flatcake_ray.actors.coordinator import CapacityCoordinator
from flatcake_ray.actors.drain import decode, encode
from flatcake_ray.actors.protocol import NodeUsage
from flatcake_ray.config import ServiceConfig
from flatcake_ray.core.gva import MAX_NODE_ID
from flatcake_ray.errors import ServiceError, UnknownNodeError

SERVICE_SECRET = "s" * 32


def coordinator_with(nodes: int) -> tuple[CapacityCoordinator, list[int]]:
    config = ServiceConfig(layers=1, page_bytes=4096, ramp_seconds=0.0)
    coordinator = CapacityCoordinator(config, SERVICE_SECRET, rebuild=False)
    ids = []
    for i in range(nodes):
        node_id = coordinator.register(SERVICE_SECRET, f"ray-{i}", f"node-{i}", None, time.time())
        coordinator.report(
            SERVICE_SECRET, node_id, f"ray-{i}", NodeUsage(node_id, 1 << 30, 0, 0, 0, 0, 0)
        )
        ids.append(node_id)
    return coordinator, ids


def test_a_drained_node_gets_no_new_scope_until_undrained():
    coordinator, (a, b, c) = coordinator_with(3)
    sticky = next(f"s{i}" for i in range(100) if coordinator.place_scope(None, f"s{i}") == b)
    assert coordinator.drain(SERVICE_SECRET, b)["drained"] is True
    placed = {coordinator.place_scope(None) for _ in range(60)}
    assert placed == {a, c}
    moved = coordinator.place_scope(None, sticky)  # its session is placed anew, and sticks there
    assert moved in (a, c) and coordinator.place_scope(None, sticky) == moved
    assert (
        coordinator.undrain(SERVICE_SECRET, b) is True
        and coordinator.undrain(SERVICE_SECRET, b) is False
    )
    assert b in {coordinator.place_scope(None) for _ in range(60)}


def test_status_views_show_the_drained_nodes():
    coordinator, (a, b) = coordinator_with(2)
    coordinator.drain(SERVICE_SECRET, a)
    assert {row["node_id"]: row["drained"] for row in coordinator.nodes_table(SERVICE_SECRET)} == {
        a: True,
        b: False,
    }
    assert coordinator.info(SERVICE_SECRET)["drained"] == [a]


def test_draining_an_unknown_node_is_a_typed_error_and_changes_nothing():
    coordinator, (a,) = coordinator_with(1)
    with pytest.raises(UnknownNodeError, match="no storage node has NodeID 99"):
        coordinator.drain(SERVICE_SECRET, 99)
    assert coordinator.drained == frozenset() and coordinator.place_scope(None) == a


def test_with_every_live_node_drained_placement_is_a_typed_error():
    coordinator, ids = coordinator_with(2)
    for node_id in ids:
        coordinator.drain(SERVICE_SECRET, node_id)
    with pytest.raises(ServiceError, match="2 drained"):
        coordinator.place_scope(None, "s")


def test_a_drained_node_id_is_kept_for_its_node_and_never_given_to_a_new_one():
    coordinator, (a, b) = coordinator_with(2)
    coordinator.drain(SERVICE_SECRET, a)
    coordinator.forget(SERVICE_SECRET, a)  # its node went away (e.g. removed) while drained
    newcomer = coordinator.register(SERVICE_SECRET, "ray-new", "node-new", None, time.time())
    assert newcomer not in (a, b)
    back = coordinator.register(
        SERVICE_SECRET, "ray-0-restarted", "node-0", a, time.time()
    )  # its own NodeID
    assert back == a and coordinator.nodes_table_row(a)["drained"] is True
    assert a not in {coordinator.place_scope(None) for _ in range(20)}


@given(st.frozensets(st.integers(1, MAX_NODE_ID), max_size=64))
def test_the_stored_drained_set_round_trips(node_ids):
    assert decode(encode(node_ids)) == node_ids


@pytest.mark.parametrize("raw", [b"[0]", b"[4096]", b"[true]", b"{}", b'["1"]', b"[1.0]", b"\xff"])
def test_a_stored_value_that_is_not_a_list_of_node_ids_is_refused(raw):
    with pytest.raises(ServiceError, match="drained-node record"):
        decode(raw)


@given(st.binary(max_size=64))
def test_garbage_decodes_to_node_ids_or_a_typed_error(raw):
    try:
        ids = decode(raw)
    except ServiceError:
        return
    assert all(1 <= i <= MAX_NODE_ID for i in ids)
