"""A storage node killed with its Ray node and started again on the same machine, everything
by the defaults and through ``flatcake-ray start``: it takes its old root (the machine's
``{host}-{slot}``, not the Ray node id), so its NodeID and its SSD scopes come back.

``ray.cluster_utils.Cluster`` puts every Ray node on this one host, so the head's storage node
and host B's hold two slots of the same default root; B's comes back to B's slot."""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

from flatcake_ray.actors.protocol import COORDINATOR_NAME, node_actor_name  # noqa: E402
from flatcake_ray.cli import main  # noqa: E402
from flatcake_ray.client import deploy  # noqa: E402
from flatcake_ray.client.client import FlatCakeClient  # noqa: E402
from flatcake_ray.config import ServiceConfig, host_name  # noqa: E402
from flatcake_ray.core.catalog import PutHints  # noqa: E402
from flatcake_ray.core.gva import Medium  # noqa: E402
from flatcake_ray.node.root_slot import SLOT_LOCK_NAME  # noqa: E402
from tests.conftest import (  # noqa: E402
    HEAD_ARGS,
    LAYERS,
    PAGE_BYTES,
    QUICK_NODE_DEATH,
    wait_for,
)
from tests.test_service import kv_for, pinned_client  # noqa: E402

NAMESPACE = f"fc-restart-{uuid.uuid4().hex[:8]}"  # its default root is this run's alone
DEFAULT_BASE = Path(ServiceConfig().root.split("{namespace}")[0]) / NAMESPACE
SSD = PutHints(turn=1)  # one-shot -> SSD
FLAGS = ["--layers", str(LAYERS), "--page-bytes", str(PAGE_BYTES), "--dram-bytes", "8MiB"]
FLAGS += ["--ssd-file-bytes", "8MiB", "--ship-bytes", "1MiB", "--landing-bytes", "4MiB"]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    assert not DEFAULT_BASE.exists()
    head = Cluster(
        initialize_head=True, head_node_args={**HEAD_ARGS, "_system_config": QUICK_NODE_DEATH}
    )
    try:
        yield head
    finally:
        try:
            if ray.is_initialized():
                deploy.stop(NAMESPACE, deploy.operator_secret(NAMESPACE))
        finally:
            ray.shutdown()
            head.shutdown()
            shutil.rmtree(DEFAULT_BASE, ignore_errors=True)


def start(cluster) -> None:
    """``flatcake-ray start`` with the default root, as ``ray up`` runs it on a joining node."""
    assert main(["start", "--address", cluster.address, "--namespace", NAMESPACE, *FLAGS]) == 0


def row_of(node_id: int) -> dict:
    secret = deploy.operator_secret(NAMESPACE)
    rows = ray.get(ray.get_actor(COORDINATOR_NAME, NAMESPACE).nodes_table.remote(secret))
    return next(r for r in rows if r["node_id"] == node_id)


def node_root(ray_node_id: str) -> str:
    node = ray.get_actor(node_actor_name(ray_node_id), NAMESPACE)
    return str(ray.get(node.stats.remote(deploy.operator_secret(NAMESPACE)))["root"])


def slot_free(root: str) -> bool:
    fd = os.open(Path(root) / SLOT_LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # also gives the lock back, if taken
    return True


def restore(client: FlatCakeClient, name: str, pages: int):
    out = np.zeros((LAYERS, pages, PAGE_BYTES), dtype=np.uint8)
    report = client.restore_report([f"{name}/{i}" for i in range(pages)], out)
    return report, out


def test_a_killed_node_started_again_by_the_defaults_serves_its_ssd_pages(cluster):
    start(cluster)  # the head first: the coordinator stays there
    host_b = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    start(cluster)
    root_b = node_root(host_b.node_id)
    assert Path(root_b).parent == DEFAULT_BASE and Path(root_b).name.startswith(host_name())
    assert node_root(cluster.head_node.node_id) != root_b  # one machine, two slots

    writer = pinned_client(host_b).remote(NAMESPACE)
    node_id = ray.get(writer.local_node_id.remote())
    assert ray.get(writer.put.remote("kept", 5, 3, SSD)).medium is Medium.SSD
    ray.kill(writer)
    cluster.remove_node(host_b, allow_graceful=False)
    wait_for("the node lost", lambda: row_of(node_id)["state"] == "lost")
    wait_for("its process gone, its slot free", lambda: slot_free(root_b))

    back = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    start(cluster)
    assert node_root(back.node_id) == root_b
    row = row_of(node_id)
    assert (row["ray_node_id"], row["state"]) == (back.node_id, "up")
    driver = FlatCakeClient(NAMESPACE)
    try:
        report, out = restore(driver, "kept", 5)
    finally:
        driver.close()
    assert (report.pages, report.node_id) == (5, node_id)
    assert np.array_equal(out, kv_for(5, 3))
