"""A storage node whose Ray node is removed (``Cluster.remove_node``), and its comeback.

Its actor is pinned to its Ray node (hard affinity), so Ray cannot restart it anywhere else:
the node is *lost*. The coordinator sees it in Ray's node table within seconds (the reports'
``node_timeout_s`` is set long here, so only that can make it lost), places nothing there,
and counts the DRAM of its last report lost; ``status`` shows it; a client that read from it
(cached location and link) gets misses, quickly, never bytes; a restarted coordinator still
knows it (GCS); ``stop`` does not hang on it.
A Ray node that comes back on the same host with the same root (``FLATCAKE_ROOT``, here a
folder that outlives the removed node) gets a storage node from ``start``, as ``ray up``
runs it on every joining node: it takes the lost node's NodeID and serves its SSD scopes,
recovered from the manifest, byte for byte.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")


from flatcake_ray.actors.protocol import COORDINATOR_NAME, NODE_NAME_PREFIX  # noqa: E402
from flatcake_ray.client import deploy  # noqa: E402
from flatcake_ray.client.client import FlatCakeClient  # noqa: E402
from flatcake_ray.core.catalog import PutHints  # noqa: E402
from flatcake_ray.core.gva import Medium  # noqa: E402
from tests.conftest import (  # noqa: E402
    LAYERS,
    PAGE_BYTES,
    QUICK_NODE_DEATH,
    SMALL_SERVICE,
    random_kv,
    wait_for,
)
from tests.test_service import pinned_client  # noqa: E402  (its client on a node, by value)

NAMESPACE = "fc-node-loss"
DRAM = PutHints(turn=2, prior_reply_tokens=1)  # short chat -> DRAM
SSD = PutHints(turn=1)  # one-shot -> SSD
LOST_WITHIN_S = 30.0
RPC_TIMEOUT_S = 5.0


def keys(name: str, pages: int) -> list[str]:
    return [f"{name}/{i}" for i in range(pages)]


def worker_on(host_root) -> dict:
    """A Ray node on 'host B': its storage node's root is ``host_root`` (its drives)."""
    return {"env_vars": {"FLATCAKE_ROOT": str(host_root)}}


def join(service, host_root):
    """A Ray node joins on host B and ``start`` gives it a storage node (what ``ray up``
    runs on a joining node); returns the Ray node."""
    node = service.cluster.add_node(num_cpus=1, **worker_on(host_root))
    service.cluster.wait_for_nodes()
    deploy.start(service.config)
    return node


@pytest.fixture(scope="module")
def loss(ray_service, tmp_path_factory):
    host_root = tmp_path_factory.mktemp("host-b")
    service = ray_service(
        NAMESPACE,
        system=QUICK_NODE_DEATH,
        **SMALL_SERVICE,
        landing_bytes=4 << 20,
        report_interval_s=0.5,
        node_timeout_s=60.0,  # reports alone would call it down only after a minute
        rpc_timeout_s=RPC_TIMEOUT_S,
        node_down_s=2.0,
        ramp_seconds=0.0,
    )
    # Host B joins after the service started on the head, as with `ray up`: the coordinator
    # stays on the head (a coordinator on the removed node would be restarted elsewhere and
    # rebuild without the lost node: docs/design-notes.md).
    host_b = join(service, host_root)
    driver = FlatCakeClient(NAMESPACE)  # on the head, beside the surviving storage node
    driver.warm_up()
    yield {
        "service": service,
        "host_root": host_root,
        "host_b": host_b,
        "writer": pinned_client(host_b).remote(NAMESPACE),  # its puts stay on host B
        "driver": driver,
        "state": {},
    }
    driver.close()


def secret() -> str:
    return deploy.operator_secret(NAMESPACE)


def coordinator():
    return ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)


def row_of(node_id: int) -> dict:
    rows = ray.get(coordinator().nodes_table.remote(secret()), timeout=30)
    return next(r for r in rows if r["node_id"] == node_id)


def restore(client, name: str, pages: int):
    out = np.zeros((LAYERS, pages, PAGE_BYTES), dtype=np.uint8)
    began = time.monotonic()
    report = client.restore_report(keys(name, pages), out)
    return report, out, time.monotonic() - began


def remove_and_wait_lost(loss, node, node_id: int) -> float:
    removed_at = time.monotonic()
    loss["service"].cluster.remove_node(node, allow_graceful=False)
    wait_for("the node lost", lambda: row_of(node_id)["state"] == "lost", LOST_WITHIN_S)
    return time.monotonic() - removed_at


def test_a_removed_node_is_lost_with_its_dram_counted_and_shown(loss):
    writer, driver = loss["writer"], loss["driver"]
    lost_id = ray.get(writer.local_node_id.remote())
    assert ray.get(writer.put.remote("bd", 3, 1, DRAM)).medium is Medium.DRAM
    assert ray.get(writer.put.remote("bs", 5, 2, SSD)).medium is Medium.SSD
    for name, pages in (("bd", 3), ("bs", 5)):  # the driver caches where they are, and links
        report, _, _ = restore(driver, name, pages)
        assert (report.pages, report.node_id) == (pages, lost_id)
    node = ray.get_actor(driver.nodes.require(lost_id).description.actor_name, NAMESPACE)
    wait_for("a report counting the DRAM scope", lambda: ray.get(node.report_now.remote()))
    loss["state"]["lost_id"] = lost_id

    took = remove_and_wait_lost(loss, loss["host_b"], lost_id)
    row = row_of(lost_id)
    assert (row["alive"], row["lost_dram_scopes"], row["lost_dram_pages"]) == (False, 1, 3)
    assert row["lost_dram_bytes"] > 0 and took < LOST_WITHIN_S
    assert ray.get(coordinator().info.remote(secret()), timeout=30)["lost"] == [lost_id]

    info = deploy.status(NAMESPACE, secret(), timeout_s=RPC_TIMEOUT_S)
    shown = {r["node_id"]: r for r in info["nodes"]}
    assert shown[lost_id]["state"] == "lost" and shown[lost_id]["alive"] is False
    assert [r["state"] for i, r in shown.items() if i != lost_id] == ["up"]
    assert f"lost: NodeID {lost_id} " in deploy.format_status(info)


def test_a_restarted_coordinator_still_knows_the_lost_node(loss):
    lost_id, handle = loss["state"]["lost_id"], coordinator()
    began = ray.get(handle.info.remote(secret()), timeout=30)["started_at"]
    ray.kill(handle, no_restart=False)  # a crash: Ray restarts it, and it rebuilds
    wait_for(
        "the coordinator restarted",
        lambda: ray.get(handle.info.remote(secret()), timeout=10)["started_at"] > began,
    )
    row = row_of(lost_id)  # the lost node answers no rebuild: its record is in the GCS
    assert (row["state"], row["lost_dram_scopes"], row["lost_dram_pages"]) == ("lost", 1, 3)


def test_reads_of_a_lost_node_miss_quickly_and_nothing_is_placed_there(loss):
    lost_id, driver = loss["state"]["lost_id"], loss["driver"]
    for name, pages in (("bd", 3), ("bs", 5)):
        report, out, took = restore(driver, name, pages)
        assert report.pages == 0 and not out.any()  # a miss: no byte written
        assert took < RPC_TIMEOUT_S + 5.0
    sessions = [f"after-{i}" for i in range(8)] + ["bs"]
    placed = [
        ray.get(coordinator().place_scope.remote(None, s, lost_id), timeout=30) for s in sessions
    ]
    assert lost_id not in placed  # not even for its own session, nor where preferred
    kv = random_kv(2, 7)
    result = driver.put(keys("bs-more", 2), kv, session_id="bs", hints=SSD)
    assert result.pages_written == 2
    report, out, _ = restore(driver, "bs-more", 2)
    assert report.pages == 2 and report.node_id != lost_id and np.array_equal(out, kv)


def test_a_node_back_on_the_host_takes_its_nodeid_and_ssd_scopes(loss):
    lost_id, driver, service = loss["state"]["lost_id"], loss["driver"], loss["service"]
    back = join(service, loss["host_root"])
    info = deploy.status(NAMESPACE, secret())
    row = next(r for r in info["nodes"] if r["ray_node_id"] == back.node_id)
    assert (row["node_id"], row["state"]) == (lost_id, "up")
    assert (row["pages"], row["lost_dram_scopes"], row["lost_dram_pages"]) == (5, 1, 3)
    assert ray.get(coordinator().info.remote(secret()), timeout=30)["lost"] == []

    report, out, _ = restore(driver, "bs", 5)  # its cached location names the same NodeID
    assert report.pages == 5 and np.array_equal(out, random_kv(5, 2))
    assert restore(driver, "bd", 3)[0].pages == 0  # DRAM did not survive the node
    loss["state"]["back"] = back


def test_stop_does_not_hang_on_a_lost_node(loss):
    lost_id = loss["state"]["lost_id"]
    remove_and_wait_lost(loss, loss["state"]["back"], lost_id)
    began = time.monotonic()
    stopped = deploy.stop(NAMESPACE)
    assert time.monotonic() - began < 30.0
    assert stopped == 2  # the head's storage node and the coordinator; nothing of the lost one
    left = [
        e["name"]
        for e in ray.util.list_named_actors(all_namespaces=True)
        if e["namespace"] == NAMESPACE
        and e["name"].startswith((NODE_NAME_PREFIX, COORDINATOR_NAME))
    ]
    assert left == []
