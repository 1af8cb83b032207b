"""The service's parts without Ray: the coordinator's placement and node ids as a plain class,
the service config's sources, and a node link rebuilding a broken transport."""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")


from flatcake_ray.actors.coordinator import CapacityCoordinator  # noqa: E402
from flatcake_ray.actors.protocol import NodeDescription, NodeUsage  # noqa: E402
from flatcake_ray.config import ServiceConfig  # noqa: E402
from flatcake_ray.core.gva import Medium  # noqa: E402
from tests.test_service import LAYERS, PAGE_BYTES, SERVICE_SECRET  # noqa: E402


# ---- the coordinator as a plain class (no Ray needed) ---------------------------------------
def usage(node_id: int, free: int) -> NodeUsage:
    return NodeUsage(node_id, free, 0, 0, 0, 0, 0)


def test_placement_is_capacity_proportional_and_ramps_a_new_node():
    config = ServiceConfig(layers=1, page_bytes=4096, ramp_seconds=100.0, ramp_floor=0.1)
    coordinator = CapacityCoordinator(config, SERVICE_SECRET, rebuild=False)
    old = coordinator.register(SERVICE_SECRET, "ray-a", "a", None, time.time() - 1000)
    new = coordinator.register(SERVICE_SECRET, "ray-b", "b", None, time.time())
    for node_id in (old, new):
        coordinator.report(
            SERVICE_SECRET, node_id, f"ray-{'a' if node_id == old else 'b'}", usage(node_id, 100)
        )
    placed = [coordinator.place_scope(None) for _ in range(110)]
    assert placed.count(new) == pytest.approx(10, abs=1)  # ramp 0.1: 1/11 of new scopes
    assert coordinator.place_scope(None, "s") == coordinator.place_scope(
        None, "s"
    )  # sessions stick


def test_scopes_placed_before_the_first_reports_spread_over_every_node():
    config = ServiceConfig(layers=1, page_bytes=4096, ramp_seconds=0.0)
    coordinator = CapacityCoordinator(config, SERVICE_SECRET, rebuild=False)
    nodes = [coordinator.register(SERVICE_SECRET, f"ray-{n}", n, None, time.time()) for n in "abc"]
    before = [coordinator.place_scope(None) for _ in range(30)]  # nobody has reported
    assert all(before.count(node_id) == 10 for node_id in nodes)
    coordinator.report(SERVICE_SECRET, nodes[0], "ray-a", usage(nodes[0], 100))
    # One node reported: the others weigh what it weighs until they report, not one byte.
    after = [coordinator.place_scope(None) for _ in range(30)]
    assert all(after.count(node_id) == 10 for node_id in nodes)
    coordinator.report(SERVICE_SECRET, nodes[1], "ray-b", usage(nodes[1], 300))
    later = [coordinator.place_scope(None) for _ in range(60)]  # weights 100, 300, 200
    assert [later.count(node_id) for node_id in nodes] == [10, 30, 20]


def test_a_writers_own_node_is_preferred_while_it_has_room():
    config = ServiceConfig(layers=1, page_bytes=4096, ramp_seconds=0.0)
    coordinator = CapacityCoordinator(config, SERVICE_SECRET, rebuild=False)
    a = coordinator.register(SERVICE_SECRET, "ray-a", "a", None, time.time() - 1000)
    b = coordinator.register(SERVICE_SECRET, "ray-b", "b", None, time.time() - 1000)
    coordinator.report(SERVICE_SECRET, a, "ray-a", usage(a, 100))
    coordinator.report(SERVICE_SECRET, b, "ray-b", usage(b, 100))
    assert {coordinator.place_scope(None, None, a) for _ in range(20)} == {a}
    assert coordinator.place_scope(None, "s", b) == b == coordinator.place_scope(None, "s", a)
    coordinator.report(SERVICE_SECRET, a, "ray-a", usage(a, 30))  # under half the mean free
    assert coordinator.place_scope(None, None, a) == b
    assert coordinator.place_scope(None, None, 4000) in (a, b)  # not a node: ignored


def test_node_ids_are_kept_on_re_registration_and_12_bit():
    coordinator = CapacityCoordinator(
        ServiceConfig(layers=1, page_bytes=4096), SERVICE_SECRET, rebuild=False
    )
    first = coordinator.register(SERVICE_SECRET, "ray-a", "a", 7, time.time())
    assert first == 7 and coordinator.register(SERVICE_SECRET, "ray-a", "a", None, time.time()) == 7
    assert (
        1 <= coordinator.register(SERVICE_SECRET, "ray-b", "b", 7, time.time()) <= 4095
    )  # 7 is taken


def test_config_file_then_flags_then_environment(tmp_path, monkeypatch):
    import argparse

    from flatcake_ray.cli.service import add_service_commands, config_from_args
    from flatcake_ray.errors import ConfigError

    path = tmp_path / "service.json"
    path.write_text(json.dumps({"layers": 8, "page_bytes": "32KiB", "ssd_dirs": ["/a", "/b"]}))
    parser = argparse.ArgumentParser()
    add_service_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["start", "--config", str(path), "--dram-bytes", "1GiB"])
    config = config_from_args(args)
    assert (config.layers, config.page_bytes, config.dram_bytes) == (8, 32 << 10, 1 << 30)
    assert config.ssd_dirs == ("/a", "/b")
    monkeypatch.setenv("FLATCAKE_LAYERS", "16")
    assert config_from_args(args).layers == 16
    path.write_text(json.dumps({"ramp_floor": 0}))
    with pytest.raises(ConfigError):
        config_from_args(args)


class _RecordingTransport:
    """A stand-in transport that records its closing and can be marked broken."""

    def __init__(self) -> None:
        self.broken = False
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_broken_transport_is_rebuilt_not_reused(monkeypatch):
    from flatcake_ray.client.nodes import NodeLink

    description = NodeDescription(
        "ray-a", 3, "node-3", LAYERS, PAGE_BYTES, "/dev/null", 0, (), 4096, True, 0.0
    )
    link = NodeLink(None, description, False, ServiceConfig(layers=LAYERS, page_bytes=PAGE_BYTES))
    made: list[_RecordingTransport] = []
    described_again: list[bool] = []

    def make(path, medium, agent, *, fresh=False):
        made.append(_RecordingTransport())
        described_again.append(fresh)
        return made[-1]

    monkeypatch.setattr(link, "_make", make)
    first, _ = link.transport("remote-dram-nixl", Medium.DRAM, None)
    assert link.transport("remote-dram-nixl", Medium.DRAM, None)[0] is first  # healthy: reused
    first.broken = True
    second, _ = link.transport("remote-dram-nixl", Medium.DRAM, None)
    assert second is not first and first.closed and len(made) == 2
    # The rebuilt one asks the node what it exports now (a chunk may be registered anew).
    assert described_again == [False, True]
