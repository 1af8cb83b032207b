"""The Ray service for real: a head plus two storage nodes on 127.0.0.1 (ray Cluster).

Clients "on node A/B" are Ray actors pinned to that node, so node detection goes by Ray node
id and a reader on B really takes the remote path for A's pages (all nodes share this
machine's /dev/shm and disk). One cluster per module; the node-removal test runs last.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

from ray import cloudpickle  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from flatcake_ray.actors.coordinator import CapacityCoordinator  # noqa: E402
from flatcake_ray.actors.protocol import COORDINATOR_NAME, NodeDescription, NodeUsage  # noqa: E402
from flatcake_ray.client import deploy as service  # noqa: E402
from flatcake_ray.client.client import FlatCakeClient  # noqa: E402
from flatcake_ray.client.deploy import operator_secret  # noqa: E402
from flatcake_ray.config import ServiceConfig  # noqa: E402
from flatcake_ray.core.catalog import PutHints  # noqa: E402
from flatcake_ray.core.gva import Medium, decode  # noqa: E402
from flatcake_ray.errors import InvalidKeyError, ShapeError, UnknownNodeError  # noqa: E402
from flatcake_ray.transports.base import (  # noqa: E402
    LOCAL_DRAM,
    LOCAL_SSD,
    OBJECT_STORE_FALLBACK,
    REMOTE_DRAM_NIXL,
    REMOTE_SSD_SHIPPED,
)
from flatcake_ray.transports.routing import route  # noqa: E402
from tests.conftest import QUICK_NODE_DEATH  # noqa: E402

SERVICE_SECRET = "s" * 32

# Workers cannot import this file by name; ship its classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NAMESPACE = "fc-test"
LAYERS = 4
PAGE_BYTES = 8192
DRAM = PutHints(turn=2, prior_reply_tokens=1)  # short chat -> DRAM
SSD = PutHints(turn=1)  # one-shot -> SSD


def kv_for(pages: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (LAYERS, pages, PAGE_BYTES), dtype=np.uint8)


def keys_for(name: str, pages: int) -> list[str]:
    return [f"{name}/{i}" for i in range(pages)]


class ClientOnNode:
    """A FlatCakeClient living on one Ray node (pinned)."""

    def __init__(self, namespace: str) -> None:
        self.client = FlatCakeClient(namespace)
        self.client.warm_up()

    def local_node_id(self) -> int:
        return self.client.nodes.local_node_id

    def put(self, name: str, pages: int, seed: int, hints: PutHints, session: str | None = None):
        keys = keys_for(name, pages)
        return self.client.put(keys, kv_for(pages, seed), session_id=session or name, hints=hints)

    def put_keys(self, keys: list[str], kv: np.ndarray, session: str, hints: PutHints, parent=None):
        return self.client.put(keys, kv, session_id=session, hints=hints, parent=parent)

    def restore(self, name: str, pages: int, seed: int | None = None, allow=None):
        client = self.client if allow is None else FlatCakeClient(NAMESPACE, allow=allow)
        out = np.zeros((LAYERS, pages, PAGE_BYTES), dtype=np.uint8)
        report = client.restore_report(keys_for(name, pages), out)
        exact = None if seed is None else bool(np.array_equal(out, kv_for(pages, seed)))
        if client is not self.client:
            client.close()
        return report, exact, out[:, : report.pages].copy()


def pinned_client(node) -> object:
    strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
    return ray.remote(ClientOnNode).options(num_cpus=0, scheduling_strategy=strategy)


@pytest.fixture(scope="module")
def deployment(ray_service):
    started = ray_service(
        NAMESPACE,
        workers=2,
        worker_args={"resources": {"fc": 1}},
        system=QUICK_NODE_DEATH,
        resource="fc",
        layers=LAYERS,
        page_bytes=PAGE_BYTES,
        dram_bytes=16 << 20,
        ssd_file_bytes=16 << 20,
        ship_bytes=8 << 20,
        landing_bytes=8 << 20,  # SSD puts over 32 pages land two slots at a time
        rpc_timeout_s=8.0,
        node_down_s=2.0,
        report_interval_s=0.5,
        node_timeout_s=3.0,
        ramp_seconds=0.0,
    )
    nodes = started.workers
    clients = [pinned_client(node).remote(NAMESPACE) for node in nodes]
    driver = FlatCakeClient(NAMESPACE)  # on the head, which has no storage node
    driver.warm_up()
    ids = ray.get([c.local_node_id.remote() for c in clients])
    yield {
        "driver": driver,
        "cluster": started.cluster,
        "config": started.config,
        "nodes": nodes,
        "by_node_id": dict(zip(ids, clients, strict=True)),
        "ray_node_of": dict(zip(ids, (n.node_id for n in nodes), strict=True)),
    }
    driver.close()


def other(deployment, node_id: int):
    return next(c for n, c in deployment["by_node_id"].items() if n != node_id)


def owner_of(deployment, name: str, pages: int) -> int:
    return decode(int(deployment["driver"].gvas(keys_for(name, pages))[0])).node_id


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
    import json

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


# ---- the service ----------------------------------------------------------------------------
def test_every_node_registered_with_its_own_node_id(deployment):
    info = service.status(NAMESPACE)
    assert sorted(row["node_id"] for row in info["nodes"]) == sorted(deployment["by_node_id"])
    assert info["coordinator"]["nodes"] == 2
    assert "coordinator" in service.format_status(info)


@pytest.mark.parametrize(
    ("medium", "hints", "local_path", "remote_path"),
    [("DRAM", DRAM, LOCAL_DRAM, REMOTE_DRAM_NIXL), ("SSD", SSD, LOCAL_SSD, REMOTE_SSD_SHIPPED)],
)
def test_written_on_one_node_restored_on_the_other(
    deployment, medium, hints, local_path, remote_path
):
    writer = next(iter(deployment["by_node_id"].values()))
    name, pages, seed = f"cross-{medium}", 40, hash(medium) % 1000
    result = ray.get(writer.put.remote(name, pages, seed, hints))
    assert (result.pages_written, result.medium.name) == (pages, medium)
    owner = owner_of(deployment, name, pages)
    local, exact_local, _ = ray.get(
        deployment["by_node_id"][owner].restore.remote(name, pages, seed)
    )
    remote, exact_remote, _ = ray.get(other(deployment, owner).restore.remote(name, pages, seed))
    assert exact_local and exact_remote
    assert list(local.paths) == [local_path] and list(remote.paths) == [remote_path]
    assert local.pages == remote.pages == pages
    # A lookup per node asked (the chain's home, then the owner it names: this reader never
    # saw the session), one `home_of`, a release, and for shipped SSD one ship and one unship
    # per window: never per page.
    assert remote.nodes_asked <= 2 and remote.actor_calls <= remote.nodes_asked + 4


def _put_counters(client) -> Counter:
    total: Counter = Counter()
    for node in client.stats()["nodes"].values():
        total.update(
            {k: v for k, v in node.items() if k.startswith(("puts_", "ssd_write", "layers"))}
        )
    return total


@pytest.mark.parametrize(("medium", "hints"), [("DRAM", DRAM), ("SSD", SSD)])
def test_puts_write_into_memory_the_owner_hands_out(deployment, medium, hints):
    """Writers on the owner's node and off it (the driver: NIXL WRITE) put straight into the
    arena (DRAM) or the owner's landing slots (SSD, two at a time for a big put), nothing in
    the call; every reader gets the exact bytes; the owner counts the memory each put used."""
    driver = deployment["driver"]
    writer = next(iter(deployment["by_node_id"].values()))
    before = _put_counters(driver)
    name, pages = f"land-{medium}", 100  # 3.3 MB: DRAM has room; SSD takes two slots
    driver.put(keys_for(name, pages), kv_for(pages, 11), session_id=name, hints=hints)
    ray.get(writer.put.remote(f"{name}-w", pages, 12, hints))
    for stored, seed in ((name, 11), (f"{name}-w", 12)):
        for reader in deployment["by_node_id"].values():
            report, exact, _ = ray.get(reader.restore.remote(stored, pages, seed))
            assert exact and report.pages == pages
    moved = _put_counters(driver) - before
    memory = "arena" if medium == "DRAM" else "landing"
    assert moved[f"puts_{memory}"] == 2 and moved["puts_inline"] == 0, moved
    assert moved["layers_landed"] == 2 * LAYERS
    if medium == "SSD":  # each layer one O_DIRECT write, straight from its slot
        assert moved["ssd_write_commands"] == 2 * LAYERS


def test_a_cold_lookup_asks_the_chains_home_not_every_node(deployment):
    """A client that never saw a chain finds it through the chain's home (derived from the
    first digest, told by the writer): no fan-out to every node, at most three calls."""
    writers = list(deployment["by_node_id"].values())
    for i in range(6):  # chains on both nodes (each writer's stay local), homes on both
        ray.get(writers[i % 2].put.remote(f"home{i}", 8, 40 + i, DRAM))
    reader = FlatCakeClient(NAMESPACE)
    try:
        for i in range(6):
            reader.forget_locations()
            report = reader.locate(keys_for(f"home{i}", 8))
            assert report.pages == 8 and report.actor_calls <= 3
        assert reader.stats(nodes=False)["client"]["fanouts"] == 0
    finally:
        reader.close()


def test_routing_follows_the_gva_bits(deployment):
    writer = next(iter(deployment["by_node_id"].values()))
    ray.get(writer.put.remote("route", 8, 3, DRAM))
    with FlatCakeClient(NAMESPACE) as client:
        gvas = client.gvas(keys_for("route", 8))
    medium, owner, _ = decode(int(gvas[0]))
    assert len(gvas) == 8 and medium.name == "DRAM"
    for reader_id, reader in deployment["by_node_id"].items():
        expected = route(int(gvas[0]), reader_id, frozenset({REMOTE_DRAM_NIXL}))
        assert expected == (LOCAL_DRAM if reader_id == owner else REMOTE_DRAM_NIXL)
        report, exact, _ = ray.get(reader.restore.remote("route", 8, 3))
        assert exact and list(report.paths) == [expected]
    # With no remote path allowed the labelled object-store fallback still serves exact bytes.
    report, exact, _ = ray.get(other(deployment, owner).restore.remote("route", 8, 3, allow=()))
    assert exact and list(report.paths) == [OBJECT_STORE_FALLBACK]


def test_concurrent_writers_to_one_scope_are_write_once(deployment):
    a, b = deployment["by_node_id"].values()
    refs = [w.put.remote("shared", 30, seed, SSD, "shared") for w, seed in ((a, 11), (b, 12))]
    results = ray.get(refs)
    assert sum(r.pages_written for r in results) == 30
    report, _, got = ray.get(a.restore.remote("shared", 30))
    assert report.pages == 30
    assert any(np.array_equal(got, kv_for(30, seed)) for seed in (11, 12))
    again = ray.get(b.put.remote("shared", 30, 13, SSD, "shared"))
    assert (again.pages_written, again.pages_skipped) == (0, 30)
    _, _, after = ray.get(b.restore.remote("shared", 30))
    assert np.array_equal(after, got)


def test_overlapping_concurrent_puts_stay_consistent(deployment):
    first = [f"ov/{i}" for i in range(20)]
    second = [f"ov/{i}" for i in range(10, 30)]
    data = {11: kv_for(20, 21), 12: kv_for(20, 22)}

    a, b = deployment["by_node_id"].values()
    ray.get(
        [
            a.put_keys.remote(first, data[11], "ov", DRAM),
            b.put_keys.remote(second, data[12], "ov", DRAM),
        ]
    )
    with FlatCakeClient(NAMESPACE) as client:
        out = np.zeros((LAYERS, 30, PAGE_BYTES), dtype=np.uint8)
        assert client.get(first[:10] + second, out) == 30
    assert np.array_equal(out[:, :10], data[11][:, :10])
    assert np.array_equal(out[:, 20:], data[12][:, 10:])
    overlap = out[:, 10:20]
    assert np.array_equal(overlap, data[11][:, 10:]) or np.array_equal(overlap, data[12][:, :10])


def test_client_validates_locally_and_fills_numpy_and_torch(deployment):
    torch = pytest.importorskip("torch")
    with FlatCakeClient(NAMESPACE) as client:
        kv = kv_for(6, 5)
        with pytest.raises(ShapeError):
            client.put([], kv)
        with pytest.raises(InvalidKeyError):
            client.put([1.5] * 6, kv)
        with pytest.raises(ShapeError):
            client.put(keys_for("val", 5), kv)
        with pytest.raises(ShapeError):
            client.get(keys_for("val", 6), np.zeros((LAYERS, 2, PAGE_BYTES), np.uint8))
        assert client.put(keys_for("val", 6), kv, session_id="val", hints=DRAM).pages_written == 6
        assert client.exists([*keys_for("val", 6), "absent"]) == 6
        tensor = torch.zeros((LAYERS, 6, PAGE_BYTES // 2), dtype=torch.float16)
        assert client.get(keys_for("val", 6), tensor) == 6
        assert np.array_equal(tensor.numpy().view(np.uint8), kv)
        out = np.zeros_like(kv)
        assert asyncio.run(client.aget(keys_for("val", 6), out)) == 6
        assert asyncio.run(client.aexists(keys_for("val", 3))) == 3
        assert np.array_equal(out, kv)
        stats = client.stats()
        assert stats["client"]["hit_pages"] >= 12 and REMOTE_DRAM_NIXL in stats["paths"]
        assert sum(n["lookups"] for n in stats["nodes"].values()) >= 2


def test_cli_start_is_idempotent_and_status_prints_the_table(deployment, capsys):
    import argparse
    import json

    from flatcake_ray.cli.service import add_service_commands

    parser = argparse.ArgumentParser(prog="flatcake-ray")
    add_service_commands(parser.add_subparsers(dest="command", required=True))
    address = deployment["cluster"].address
    common = ["--address", address, "--namespace", NAMESPACE]
    geometry = ["--layers", str(LAYERS), "--page-bytes", str(PAGE_BYTES)]
    args = parser.parse_args(["start", *common, *geometry, "--resource", "fc"])
    assert args.handler(args) == 0  # finds the running actors, starts nothing new
    args = parser.parse_args(["status", *common, "--json"])
    capsys.readouterr()
    assert args.handler(args) == 0
    info = json.loads(capsys.readouterr().out)
    assert sorted(r["node_id"] for r in info["nodes"]) == sorted(deployment["by_node_id"])
    assert all(r["pages"] > 0 for r in info["nodes"]) and info["coordinator"]["nodes"] == 2
    args = parser.parse_args(["status", *common])
    assert args.handler(args) == 0
    table = capsys.readouterr().out
    assert "dram GiB used/cap" in table and "coordinator: 2 nodes" in table
    assert parser.parse_args(["bench", "restore", "--nodes", "2"]).handler.__name__ == (
        "cmd_bench_restore"
    )


def test_cli_start_with_another_geometry_is_an_error_naming_both(deployment, capsys):
    from flatcake_ray.cli import main

    common = ["--address", deployment["cluster"].address, "--namespace", NAMESPACE]
    wanted = ["--layers", str(LAYERS + 1), "--page-bytes", str(PAGE_BYTES), "--resource", "fc"]
    capsys.readouterr()
    assert main(["start", *common, *wanted]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("flatcake-ray: error: "), lines
    assert f"layers={LAYERS}," in lines[0] and f"layers={LAYERS + 1}," in lines[0]
    info = service.status(NAMESPACE)  # the running service is untouched
    assert sorted(row["node_id"] for row in info["nodes"]) == sorted(deployment["by_node_id"])


def test_cli_status_from_a_fresh_process_connects(deployment):
    """The bounded connect (TCP probe, Ray's health check, then ray.init) on a live cluster."""
    argv = ["status", "--address", deployment["cluster"].address, "--namespace", NAMESPACE]
    code = f"import sys; from flatcake_ray.cli import main; sys.exit(main({[*argv, '--json']}))"
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180
    )
    assert child.returncode == 0, child.stderr
    assert len(json.loads(child.stdout)["nodes"]) == len(deployment["by_node_id"])


@pytest.mark.gpu
def test_get_into_a_cuda_tensor(deployment):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    client = deployment["driver"]
    kv = kv_for(5, 77)
    client.put(keys_for("cuda", 5), kv, session_id="cuda", hints=DRAM)
    out = torch.zeros((LAYERS, 5, PAGE_BYTES), dtype=torch.uint8, device="cuda")
    assert client.get(keys_for("cuda", 5), out) == 5
    assert np.array_equal(out.cpu().numpy(), kv)


def _coordinator():
    return ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)


def _wait_ping(timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(_coordinator().ping.remote(), timeout=5)
        except (ValueError, ray.exceptions.RayError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_coordinator_killed_and_restarted_recovers(deployment):
    writer = next(iter(deployment["by_node_id"].values()))
    ray.get(writer.put.remote("before-kill", 10, 31, DRAM))
    owner = owner_of(deployment, "before-kill", 10)
    table = {
        r["node_id"]: r["ray_node_id"]
        for r in ray.get(_coordinator().nodes_table.remote(operator_secret(NAMESPACE)))
    }
    ray.kill(_coordinator(), no_restart=True)
    with FlatCakeClient(NAMESPACE) as client:  # reads never ask the coordinator
        out = np.zeros((LAYERS, 10, PAGE_BYTES), dtype=np.uint8)
        assert client.get(keys_for("before-kill", 10), out) == 10
        assert np.array_equal(out, kv_for(10, 31))
        assert (
            client.put(keys_for("while-dead", 4), kv_for(4, 32), session_id="wd").pages_written == 4
        )
    service.start_coordinator(
        deployment["config"], operator_secret(NAMESPACE)
    )  # a fresh one rebuilds from the nodes
    _wait_ping()
    rebuilt = {
        r["node_id"]: r["ray_node_id"]
        for r in ray.get(_coordinator().nodes_table.remote(operator_secret(NAMESPACE)))
    }
    assert rebuilt == table
    assert ray.get(_coordinator().place_scope.remote(None, "before-kill")) == owner
    ray.kill(_coordinator(), no_restart=False)  # a crash: Ray restarts it, it rebuilds again
    time.sleep(1.0)
    _wait_ping()
    assert ray.get(_coordinator().place_scope.remote(None, "before-kill")) == owner
    assert ray.get(_coordinator().info.remote(operator_secret(NAMESPACE)))["rebuilt_nodes"] == 2


def _cli(*argv: str) -> int:
    import argparse

    from flatcake_ray.cli.service import add_service_commands

    parser = argparse.ArgumentParser(prog="flatcake-ray")
    add_service_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.handler(args)


def _status_json(capsys, common: list[str]) -> dict:
    import json

    capsys.readouterr()
    assert _cli("status", *common, "--json") == 0
    return json.loads(capsys.readouterr().out)


def test_drain_moves_new_chains_off_a_node_and_survives_a_coordinator_restart(deployment, capsys):
    from flatcake_ray.client.nodes import REFRESH_EVERY_S

    common = ["--address", deployment["cluster"].address, "--namespace", NAMESPACE]
    drained, kept = sorted(deployment["by_node_id"])
    writer, reader = deployment["by_node_id"][drained], deployment["by_node_id"][kept]
    old = next(f"dr-old-{i}" for i in range(20) if _put_owner(deployment, writer, i) == drained)
    try:
        assert _cli("drain", str(drained), *common) == 0
        assert f"NodeID {drained}" in capsys.readouterr().out
        rows = {r["node_id"]: r["drained"] for r in _status_json(capsys, common)["nodes"]}
        assert rows == {drained: True, kept: False}
        assert _cli("status", *common) == 0
        assert f"drained (no new scopes; undo with `flatcake-ray undrain`): {drained}" in (
            capsys.readouterr().out
        )
        time.sleep(REFRESH_EVERY_S)  # the writer's next node refresh sees the drain
        for i in range(4):  # new sessions; then a tail and a new chain of a session there
            ray.get(writer.put.remote(f"dr-new-{i}", 4, 60 + i, DRAM))
            assert owner_of(deployment, f"dr-new-{i}", 4) == kept
        tail = [f"{old}/tail/{i}" for i in range(3)]  # a chain's tail stays beside its head
        ray.get(writer.put_keys.remote(tail, kv_for(3, 71), old, DRAM, f"{old}/3"))
        assert decode(int(deployment["driver"].gvas(tail)[0])).node_id == drained
        ray.get(writer.put.remote("dr-new-chain", 4, 70, DRAM, old))
        assert owner_of(deployment, "dr-new-chain", 4) == kept
        _, exact, _ = ray.get(reader.restore.remote(old, 4, 50 + int(old.rsplit("-", 1)[1])))
        assert exact  # its pages stay readable
        ray.kill(_coordinator(), no_restart=False)  # a crash: the restarted one rebuilds
        time.sleep(1.0)
        _wait_ping()
        assert _status_json(capsys, common)["coordinator"]["drained"] == [drained]
        placed = {ray.get(_coordinator().place_scope.remote(None)) for _ in range(20)}
        assert placed == {kept}
    finally:
        assert _cli("undrain", str(drained), *common) == 0
    assert "undrained" in capsys.readouterr().out
    assert not any(r["drained"] for r in _status_json(capsys, common)["nodes"])
    assert drained in {ray.get(_coordinator().place_scope.remote(None)) for _ in range(20)}
    with pytest.raises(UnknownNodeError, match="no storage node has NodeID 4000 "):
        _cli("drain", "4000", *common)  # main() prints it as one line (test_cli)


def _put_owner(deployment, writer, i: int) -> int:
    ray.get(writer.put.remote(f"dr-old-{i}", 4, 50 + i, DRAM))
    return owner_of(deployment, f"dr-old-{i}", 4)


def test_removed_node_turns_its_pages_into_misses(deployment):
    """Last: it takes a node away. Reads keep going throughout; none hangs or lies."""
    writers = list(deployment["by_node_id"].values())  # each writer's sessions stay local
    owners: dict[int, str] = {}
    for i in range(8):
        name = f"rm-{i}"
        ray.get(writers[i % 2].put.remote(name, 12, 40 + i, DRAM))
        owners.setdefault(owner_of(deployment, name, 12), name)
        if len(owners) == 2:
            break
    assert len(owners) == 2, "placement never used both nodes"
    doomed = max(owners)
    seeds = {name: 40 + int(name.split("-")[1]) for name in owners.values()}
    log: list[tuple[float, str, int, bool, float]] = []
    stop = threading.Event()

    def reader():
        with FlatCakeClient(NAMESPACE) as client:
            while not stop.is_set():
                for name, seed in seeds.items():
                    out = np.zeros((LAYERS, 12, PAGE_BYTES), dtype=np.uint8)
                    began = time.monotonic()
                    got = client.get(keys_for(name, 12), out)
                    exact = np.array_equal(out[:, :got], kv_for(12, seed)[:, :got])
                    log.append((began, name, got, exact, time.monotonic() - began))

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(3.0)
    removed_at = time.monotonic()
    victim = next(n for n in deployment["nodes"] if n.node_id == deployment["ray_node_of"][doomed])
    deployment["cluster"].remove_node(victim, allow_graceful=False)
    deadline = removed_at + 45.0
    while time.monotonic() < deadline:
        if any(t > removed_at and name == owners[doomed] and got == 0 for t, name, got, *_ in log):
            break
        time.sleep(0.25)
    time.sleep(3.0)
    stop.set()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert all(exact for *_, exact, _ in log), "a read returned wrong bytes"
    limit = deployment["config"].rpc_timeout_s + 5.0
    assert max(took for *_, took in log) < limit, "a read hung"
    misses = [
        t for t, name, got, *_ in log if t > removed_at and name == owners[doomed] and got == 0
    ]
    assert misses and misses[0] - removed_at < 30.0
    survivor = next(name for node, name in owners.items() if node != doomed)
    late = [got for t, name, got, *_ in log if name == survivor and t > misses[0]]
    assert late and all(got == 12 for got in late)


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

    def make(path, medium, agent):
        made.append(_RecordingTransport())
        return made[-1]

    monkeypatch.setattr(link, "_make", make)
    first, _ = link.transport("remote-dram-nixl", Medium.DRAM, None)
    assert link.transport("remote-dram-nixl", Medium.DRAM, None)[0] is first  # healthy: reused
    first.broken = True
    second, _ = link.transport("remote-dram-nixl", Medium.DRAM, None)
    assert second is not first and first.closed and len(made) == 2
