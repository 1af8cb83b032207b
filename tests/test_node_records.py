"""The coordinator's view of a lost node, as a plain object: Ray's node table is a set here.

A node is lost when the table no longer calls its Ray node alive; it then takes no scope,
its row counts the DRAM of its last report lost, and a node that comes back with its NodeID
gets it at once. The service itself is tested in ``test_node_loss.py``.
"""

from __future__ import annotations

import time

from flatcake_ray.actors.coordinator import CapacityCoordinator
from flatcake_ray.actors.node_records import LOST, SILENT, UP, NodeRecord, RayNodeWatch
from flatcake_ray.actors.protocol import NodeUsage
from flatcake_ray.config import ServiceConfig

SERVICE_SECRET = "s" * 32
MIB = 1 << 20


def coordinator_with(alive: set[str]) -> CapacityCoordinator:
    """Nodes on Ray nodes "ray-a" and "ray-b", both reporting; ``alive`` is Ray's table."""
    config = ServiceConfig(layers=1, page_bytes=4096, ramp_seconds=0.0, node_timeout_s=600.0)
    coordinator = CapacityCoordinator(config, SERVICE_SECRET, rebuild=False)
    coordinator.watch = RayNodeWatch(lambda: alive, every_s=0.0)
    for name in ("a", "b"):
        node_id = coordinator.register(SERVICE_SECRET, f"ray-{name}", name, None, time.time())
        usage = NodeUsage(node_id, 8 * MIB, 3 * MIB, 64 * MIB, 0, 4, 40, 2, 24)
        assert coordinator.report(SERVICE_SECRET, node_id, f"ray-{name}", usage)
    return coordinator


def test_a_node_whose_ray_node_died_is_lost_and_takes_no_scope():
    alive = {"ray-a", "ray-b"}
    coordinator = coordinator_with(alive)
    a, b = sorted(coordinator.nodes)
    assert coordinator.place_scope(None, "s", b) == b  # a session placed there, up
    alive.discard("ray-b")
    row = coordinator.nodes_table_row(b)
    assert (row["state"], row["alive"]) == (LOST, False)
    assert (row["lost_dram_scopes"], row["lost_dram_pages"], row["lost_dram_bytes"]) == (
        2,
        24,
        3 * MIB,
    )
    assert coordinator.info(SERVICE_SECRET)["lost"] == [b]
    assert {coordinator.place_scope(None, f"x{i}", b) for i in range(20)} == {a}
    assert coordinator.place_scope(None, "s", b) == a  # its own session is placed anew
    up = coordinator.nodes_table_row(a)
    assert (up["state"], up["lost_dram_scopes"]) == (UP, 0)


def test_a_node_back_on_the_host_gets_the_lost_nodeid_at_once():
    alive = {"ray-a", "ray-b"}
    coordinator = coordinator_with(alive)
    b = max(coordinator.nodes)
    alive.discard("ray-b")
    alive.add("ray-b2")  # a new Ray node on the host, its root naming NodeID b
    assert coordinator.register(SERVICE_SECRET, "ray-b2", "b2", b, time.time()) == b
    row = coordinator.nodes_table_row(b)
    assert (row["ray_node_id"], row["state"], row["lost_dram_scopes"]) == ("ray-b2", UP, 0)
    assert coordinator.info(SERVICE_SECRET)["lost"] == []


def test_a_live_holder_keeps_its_nodeid():
    coordinator = coordinator_with({"ray-a", "ray-b", "ray-c"})
    b = max(coordinator.nodes)
    assert coordinator.register(SERVICE_SECRET, "ray-c", "c", b, time.time()) not in (b, 0)


def test_a_node_that_stops_reporting_is_silent_and_nothing_counts_lost():
    config = ServiceConfig(layers=1, page_bytes=4096, node_timeout_s=10.0)
    now = time.time()
    usage = NodeUsage(1, MIB, MIB, 0, 0, 1, 1, 1, 1)
    record = NodeRecord(1, "ray-a", "a", now - 100, now - 11, usage)
    assert record.state(now, config, ray_dead=False) == SILENT
    assert record.row(now, config)["lost_dram_scopes"] == 0  # it may still be running
    assert record.row(now, config, ray_dead=True)["lost_dram_scopes"] == 1


def test_the_watch_reads_rays_table_at_most_every_interval():
    reads: list[int] = []

    def table() -> set[str]:
        reads.append(1)
        return {"ray-a"}

    watch = RayNodeWatch(table, every_s=3600.0)
    assert not watch.dead("ray-a") and watch.dead("ray-b") and len(reads) == 1
    assert watch.dead("ray-b", fresh=True) and len(reads) == 2
