"""Supervision: a killed storage node or coordinator comes back by itself.

A storage node's process is killed (``ray.kill(..., no_restart=False)``, what a crash looks
like to Ray); Ray restarts the actor on its node and root. Its SSD pages come back from the
manifest byte for byte, its DRAM pages are gone and reported lost, and a client that had
read from it before (its location cache and its mapping of the old arena) gets a miss or the
restarted node's new bytes, never the dead process's old ones. The coordinator, killed the
same way, comes back with its node table rebuilt and places new sessions again.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

from flatcake_ray.actors.protocol import COORDINATOR_NAME  # noqa: E402
from flatcake_ray.client import deploy  # noqa: E402
from flatcake_ray.client.client import FlatCakeClient  # noqa: E402
from flatcake_ray.core.catalog import PutHints  # noqa: E402
from flatcake_ray.core.gva import Medium  # noqa: E402
from tests.conftest import LAYERS, PAGE_BYTES, SMALL_SERVICE, random_kv, wait_for  # noqa: E402

NAMESPACE = "fc-supervision"
DRAM = PutHints(turn=2, prior_reply_tokens=1)  # short chat -> DRAM
SSD = PutHints(turn=1)  # one-shot -> SSD


def keys(name: str, pages: int) -> list[str]:
    return [f"{name}/{i}" for i in range(pages)]


@pytest.fixture(scope="module")
def service(ray_service):
    return ray_service(
        NAMESPACE,
        **SMALL_SERVICE,
        landing_bytes=4 << 20,
        report_interval_s=0.5,
        ramp_seconds=0.0,
        rpc_timeout_s=30.0,
    ).config


@pytest.fixture
def clients(service):
    made = [FlatCakeClient(NAMESPACE), FlatCakeClient(NAMESPACE)]
    yield made
    for client in made:
        client.close()


def secret() -> str:
    return deploy.operator_secret(NAMESPACE)


def restore(client, names, pages: int):
    out = np.zeros((LAYERS, pages, PAGE_BYTES), dtype=np.uint8)
    return client.restore_report(names, out), out


def test_a_killed_storage_node_comes_back_with_its_ssd_pages_and_no_old_bytes(clients):
    reader, writer = clients
    old_dram, ssd = random_kv(3, 1), random_kv(5, 2)
    assert reader.put(keys("d", 3), old_dram, session_id="d", hints=DRAM).medium is Medium.DRAM
    assert reader.put(keys("s", 5), ssd, session_id="s", hints=SSD).medium is Medium.SSD
    before, out = restore(reader, keys("d", 3), 3)  # the reader maps the node's arena now
    assert before.pages == 3 and np.array_equal(out, old_dram)
    link = reader.nodes.require(before.node_id)
    node = ray.get_actor(link.description.actor_name, namespace=NAMESPACE)
    wait_for("a report counting the DRAM scope", lambda: ray.get(node.report_now.remote()))

    ray.kill(node, no_restart=False)
    stats = wait_for(
        "the node restarted",
        lambda: (s := ray.get(node.stats.remote(secret()), timeout=10))["restarts"] == 1 and s,
    )
    assert stats["node_id"] == before.node_id  # it keeps its NodeID
    assert (stats["lost_dram_scopes"], stats["lost_dram_pages"]) == (1, 3)
    assert stats["pages_indexed"] == 5  # the SSD scope, from the manifest

    # New bytes under the old keys, put by another client into the new arena; the reader
    # still holds its description (and arena mapping) of the dead process.
    new_dram = random_kv(3, 3)
    assert writer.put(keys("d", 3), new_dram, session_id="d2", hints=DRAM).medium is Medium.DRAM
    seen = []
    for _ in range(2):
        report, out = restore(reader, keys("d", 3), 3)
        assert report.pages in (0, 3)
        assert np.array_equal(out, new_dram if report.pages else np.zeros_like(out))
        seen.append(report.pages)
    # Never the old bytes: the stale lease is refused and the node described anew; the
    # chain's homes then lead to the new bytes at once (or the first request misses).
    assert seen[-1] == 3 and seen[0] in (0, 3)
    assert reader.nodes.require(before.node_id).description.started_at > link.description.started_at

    report, out = restore(reader, keys("s", 5), 5)
    assert report.pages == 5 and np.array_equal(out, ssd)  # byte for byte, from the manifest


def test_a_killed_coordinator_comes_back_and_places_again(clients, service):
    reader, _ = clients
    coordinator = ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)
    info = ray.get(coordinator.info.remote(secret()), timeout=30)
    nodes = ray.get(coordinator.nodes_table.remote(secret()), timeout=30)

    ray.kill(coordinator, no_restart=False)
    wait_for(
        "the coordinator restarted",
        lambda: (
            ray.get(coordinator.info.remote(secret()), timeout=10)["started_at"]
            > info["started_at"]
        ),
    )
    rebuilt = ray.get(coordinator.nodes_table.remote(secret()), timeout=30)
    assert [(r["node_id"], r["ray_node_id"]) for r in rebuilt] == [
        (r["node_id"], r["ray_node_id"]) for r in nodes
    ]
    kv = random_kv(2, 4)
    placed = reader.put(keys("after", 2), kv, session_id="new-session", hints=SSD)
    assert placed.pages_written == 2
    report, out = restore(reader, keys("after", 2), 2)
    assert report.pages == 2 and np.array_equal(out, kv)


class _GoneNode:
    """Answers nothing: killed before it is asked (a storage node that died)."""

    def hand_chunks(self, secret, socket_name, memory, offsets=None):
        raise AssertionError("a dead actor ran a call")


def test_a_node_that_dies_before_handing_out_memory_is_a_typed_transfer_error(clients):
    """A put maps the owner's chunk after ``begin_put`` (``PutTargets.mapped``): an owner that
    died in between is ``PeerDisconnectedError`` (typed, a restore's miss), not Ray's own."""
    from flatcake_ray.client.calls import BoundNode
    from flatcake_ray.client.nodes import NodeLink
    from flatcake_ray.errors import PeerDisconnectedError

    reader = clients[0]
    real = reader.nodes.require(reader.nodes.local_node_id)
    gone = ray.remote(_GoneNode).options(num_cpus=0).remote()
    ray.kill(gone, no_restart=True)
    link = NodeLink(BoundNode(gone, None), real.description, True, reader.config)
    with pytest.raises(PeerDisconnectedError, match="went away handing out its arena"):
        link.hand_chunks("arena")
