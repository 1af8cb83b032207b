"""A named tenant's SSD pages through the live service on two storage nodes: sealed on the
owner's drive, shipped as they lie there (the owner never unseals them), unsealed by the
reader on the other node, and by the reader on the owner's node (issue 23)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

from ray import cloudpickle  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from flatcake_ray.core.catalog import PutHints  # noqa: E402
from flatcake_ray.core.gva import decode  # noqa: E402
from flatcake_ray.transports.base import LOCAL_SSD, REMOTE_SSD_SHIPPED  # noqa: E402
from tests.conftest import LAYERS, PAGE_BYTES, lines_found, marked_kv  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
NAMESPACE = "fc-sealed-remote"
SSD = PutHints(turn=1)


class TenantClient:
    """A client of one tenant, living on one Ray node."""

    def __init__(self, secret: str) -> None:
        from flatcake_ray.client.client import FlatCakeClient
        from flatcake_ray.config import ClientConfig

        self.client = FlatCakeClient(NAMESPACE, config=ClientConfig(tenant_secret=secret))

    def node_id(self) -> int:
        return self.client.nodes.local_node_id

    def put(self, keys: list[str], data: np.ndarray) -> str:
        return self.client.put(keys, data, hints=SSD).medium.name

    def owner(self, keys: list[str]) -> int:
        return decode(int(self.client.gvas(keys)[0])).node_id

    def pool_paths(self, node_id: int) -> list[str]:
        link = self.client.nodes.links[node_id]
        return list(ray.get(link.handle.describe.remote(), timeout=30).pool_paths)

    def restore(self, keys: list[str], data: np.ndarray) -> tuple[int, bool, list[str]]:
        out = np.zeros_like(data)
        report = self.client.restore_report(keys, out)
        return report.pages, bool(np.array_equal(out, data)), list(report.paths)


@pytest.fixture(scope="module")
def clients(ray_service):
    from flatcake_ray.client import tenants

    started = ray_service(
        NAMESPACE,
        workers=2,
        worker_args={"resources": {"fc": 1}},
        resource="fc",
        layers=LAYERS,
        page_bytes=PAGE_BYTES,
        dram_bytes=8 << 20,
        ssd_file_bytes=16 << 20,
        ship_bytes=4 << 20,
        landing_bytes=4 << 20,
        ramp_seconds=0.0,
    )
    secret = tenants.add_tenant(
        NAMESPACE, "sealed", layers=LAYERS, page_bytes=PAGE_BYTES, timeout_s=60.0
    )
    made = []
    for node in started.workers:
        strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        actor = ray.remote(TenantClient).options(num_cpus=0, scheduling_strategy=strategy)
        made.append(actor.remote(secret))
    by_node = dict(zip(ray.get([c.node_id.remote() for c in made]), made, strict=True))
    yield by_node


def test_sealed_pages_ship_sealed_and_unseal_at_either_reader(clients):
    writer = next(iter(clients.values()))
    data = marked_kv(200, seed=31)  # 6.5 MB through a 4 MiB ship buffer: several windows
    keys = [f"far/{i}" for i in range(200)]
    assert ray.get(writer.put.remote(keys, data), timeout=60) == "SSD"
    owner = ray.get(writer.owner.remote(keys), timeout=30)
    reader = next(c for n, c in clients.items() if n != owner)
    pages, exact, paths = ray.get(reader.restore.remote(keys, data), timeout=60)
    assert (pages, exact, paths) == (200, True, [REMOTE_SSD_SHIPPED])
    pages, exact, paths = ray.get(clients[owner].restore.remote(keys, data), timeout=60)
    assert (pages, exact, paths) == (200, True, [LOCAL_SSD])
    pool = b"".join(
        Path(p).read_bytes() for p in ray.get(reader.pool_paths.remote(owner), timeout=30)
    )
    assert lines_found(data, pool) == 0
