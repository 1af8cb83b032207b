"""Operating the Ray service for real: the CLI's start and status, a coordinator killed and
restarted, draining a node, and a node removed (its pages turn into misses; it runs last).

A head plus two storage nodes on 127.0.0.1, as in ``test_service.py``, in a cluster of this
module's own."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.long]

ray = pytest.importorskip("ray")


from flatcake_ray.actors.protocol import COORDINATOR_NAME  # noqa: E402
from flatcake_ray.client import deploy as service  # noqa: E402
from flatcake_ray.client.client import FlatCakeClient  # noqa: E402
from flatcake_ray.client.deploy import operator_secret  # noqa: E402
from flatcake_ray.core.gva import decode  # noqa: E402
from flatcake_ray.errors import UnknownNodeError  # noqa: E402
from tests.test_service import (  # noqa: E402
    DRAM,
    LAYERS,
    NAMESPACE,
    PAGE_BYTES,
    keys_for,
    kv_for,
    owner_of,
    two_node_deployment,
)


@pytest.fixture(scope="module")
def deployment(ray_service):
    yield from two_node_deployment(ray_service)


def test_cli_start_is_idempotent_and_status_prints_the_table(deployment, capsys):
    for node_id, writer in deployment["by_node_id"].items():  # pages on every node to report
        ray.get(writer.put.remote(f"status-{node_id}", 2, node_id, DRAM))
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


def _coordinator():
    return ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)


def _wait_ping(timeout_s: float = 180.0):
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
