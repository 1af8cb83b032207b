"""A cold lookup on a storage node's machine: when the chain's home there (asked over its call
channel) holds the whole request, the other home's answer, asked over Ray, is not waited for;
it is read later (before this client's next put, or its stats), and what it leased goes back
(``client/locate.py`` ``_settle_late``). Two storage nodes, the driver on the first; the
client asks the other node over Ray (``remote_direct_calls`` off: with a call channel there,
both homes' answers are read, their round trips overlapped)."""

from __future__ import annotations

import numpy as np
import pytest

from flatcake_ray.core.catalog import PutHints
from tests.conftest import LAYERS, PAGE_BYTES, SMALL_SERVICE

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

NAMESPACE = "fc-cold-lookup"
DRAM = PutHints(turn=2, prior_reply_tokens=1)
PAGES = 6


@pytest.fixture(scope="module")
def client(ray_service):
    from flatcake_ray.client.client import FlatCakeClient
    from flatcake_ray.config import ClientConfig

    ray_service(NAMESPACE, workers=1, **SMALL_SERVICE, ramp_seconds=0.0)
    config = ClientConfig(remote_direct_calls=False)
    with FlatCakeClient(NAMESPACE, config=config) as client:
        yield client


def chain(name: str) -> list[str]:
    return [f"{name}/{i}" for i in range(PAGES)]


def test_a_cold_lookup_the_local_home_answers_whole_waits_for_no_other_home(client):
    data = np.random.default_rng(3).integers(0, 256, (LAYERS, PAGES, PAGE_BYTES), np.uint8)
    local = client.nodes.local_node_id
    client.nodes.refresh(force=True)
    assert len(client.nodes.up()) == 2
    names = None
    for i in range(16):  # chains are placed over both nodes: find one held on this machine
        candidate = chain(f"c{i}")
        client.put(candidate, data, session_id=f"c{i}", hints=DRAM)
        if client.locate(candidate).node_id == local:
            names = candidate
            break
    assert names is not None, "no chain of 16 was placed on the driver's node"
    client.forget_locations()
    before = client.stats(nodes=False)["client"]["finds_unawaited"]
    report = client.locate(names, lease=True)
    assert report.pages == PAGES and report.node_id == local and report.direct_calls >= 1
    assert client.stats(nodes=False)["client"]["finds_unawaited"] == before + 1
    # The other home's answer is read before the stats below; nothing of this client's stays
    # leased on either node once its let-go lease has gone back with a lookup.
    out = np.zeros_like(data)
    assert client.restore_report(names, out).pages == PAGES and np.array_equal(out, data)
    nodes = client.stats()["nodes"]
    assert sum(node["leases_open"] for node in nodes.values()) == 0
