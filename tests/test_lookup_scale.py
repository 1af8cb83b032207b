"""A lookup costs the same few calls at any cluster size (``client/locate.py``), counted on 8
local storage nodes: a miss asks at most 2 nodes and a hit at most 3, before and after a node
joins and after one leaves, and a chain whose home moved is still found and re-recorded at
its new home. Chains that share their first page (a system prompt) have their homes spread
over the nodes, and the same bounds hold for them. Counts, never timings."""

from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from flatcake_ray.actors.protocol import COORDINATOR_NAME, node_actor_name  # noqa: E402
from flatcake_ray.client import deploy  # noqa: E402
from flatcake_ray.client.client import FlatCakeClient  # noqa: E402
from flatcake_ray.client.source import first_digest  # noqa: E402
from flatcake_ray.core.catalog import PutHints  # noqa: E402
from flatcake_ray.core.homes import anchor_index, home_candidates  # noqa: E402
from tests.conftest import LAYERS, PAGE_BYTES, SMALL_SERVICE, wait_for  # noqa: E402

pytestmark = pytest.mark.long

NAMESPACE = "fc-lookup-scale"
RESOURCE = "fcscale"
NODES = 8
CHAINS = 48  # a joining ninth node becomes the first home of 1/9 of them: 5 expected
PAGES = 4
DRAM = PutHints(turn=2, prior_reply_tokens=1)  # short chat -> DRAM
SYSTEM = "system-prompt/0"  # the first page of every chain of the shared-prefix test
SHARED_CHAINS = 12


def chain(name: str) -> list[str]:
    return [f"{name}/{i}" for i in range(PAGES)]


@pytest.fixture(scope="module")
def scale(ray_service):
    started = ray_service(
        NAMESPACE,
        workers=NODES,
        worker_args={"num_cpus": 0, "resources": {RESOURCE: 1}},
        resource=RESOURCE,
        **SMALL_SERVICE,
        landing_bytes=1 << 20,
        rpc_timeout_s=20.0,
        ramp_seconds=0.0,
    )
    # The driver is on the head, which has no storage node: chains are placed over all 8,
    # once every node has registered and reported (a node not registered yet takes none).
    wait_for("every storage node's first report", every_node_reported, timeout_s=180)
    writer = FlatCakeClient(NAMESPACE)
    kv = np.ones((LAYERS, PAGES, PAGE_BYTES), np.uint8)
    for i in range(CHAINS):
        writer.put(chain(f"c{i}"), kv, session_id=f"c{i}", hints=DRAM)
    yield {"service": started, "writer": writer}
    writer.close()


def every_node_reported() -> bool:
    coordinator = ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)
    rows = ray.get(coordinator.nodes_table.remote(deploy.operator_secret(NAMESPACE)), timeout=30)
    return len(rows) == NODES and all(row["dram_capacity"] > 0 for row in rows)


def lookups(expect_found: dict[str, bool]) -> dict[str, list]:
    """A fresh client (cold location cache) locates every chain, with and without a lease,
    and as many chains no node holds; the reports by kind."""
    reports: dict[str, list] = {"hit": [], "miss": [], "lost": []}
    with FlatCakeClient(NAMESPACE) as reader:
        for name, found in expect_found.items():
            for lease in (False, True):
                reader.forget_locations()
                report = reader.locate(chain(name), lease=lease)
                assert report.pages == (PAGES if found else 0), (name, lease, report)
                reports["hit" if found else "lost"].append(report)
        for i in range(len(expect_found)):
            report = reader.locate(chain(f"never-stored-{i}"), lease=bool(i % 2))
            assert report.pages == 0
            reports["miss"].append(report)
        assert reader.stats(nodes=False)["client"]["fanouts"] == 0
    return reports


def assert_bounded(reports: dict[str, list]) -> None:
    assert max(r.nodes_asked for r in reports["miss"]) <= 2
    assert max(r.actor_calls for r in reports["miss"]) <= 2
    assert max(r.nodes_asked for r in reports["hit"]) <= 3
    assert max((r.nodes_asked for r in reports["lost"]), default=0) <= 2


def node_ids(client: FlatCakeClient) -> list[int]:
    client.nodes.refresh(force=True)
    return sorted(link.node_id for link in client.nodes.up())


def home_record(client: FlatCakeClient, node_id: int, name: str) -> int | None:
    return record_of(client, node_id, _first(name))


def record_of(client: FlatCakeClient, node_id: int, page: bytes) -> int | None:
    return ray.get(client.nodes.require(node_id).handle.home_of.remote(page))


def _first(name: str) -> bytes:
    """The chain's anchor: the page its homes are chosen by (``core/homes.py``)."""
    return first_digest(chain(name)[anchor_index(PAGES) :], None)


def test_before_any_change_a_miss_asks_two_nodes_and_a_hit_at_most_three(scale):
    assert len(node_ids(scale["writer"])) == NODES
    reports = lookups({f"c{i}": True for i in range(CHAINS)})
    assert_bounded(reports)
    # Chains owned by their first home are found in one round trip: both homes asked.
    assert min(r.nodes_asked for r in reports["hit"]) <= 2


def test_chains_sharing_a_first_page_spread_over_homes_and_lookups_stay_bounded(scale):
    writer = scale["writer"]
    ids = node_ids(writer)
    shared = [[SYSTEM, *chain(f"s{i}")[1:]] for i in range(SHARED_CHAINS)]  # one system page
    kv = np.ones((LAYERS, PAGES, PAGE_BYTES), np.uint8)
    for i, keys in enumerate(shared):
        writer.put(keys, kv, session_id=f"s{i}", hints=DRAM)
    anchors = [first_digest(keys[anchor_index(PAGES) :], None) for keys in shared]
    assert len({home_candidates(anchor, ids)[0] for anchor in anchors}) > 1
    system = first_digest([SYSTEM], None)  # the shared page is nobody's name: no hot record
    assert all(record_of(writer, home, system) is None for home in home_candidates(system, ids))
    with FlatCakeClient(NAMESPACE) as reader:
        for i, keys in enumerate(shared):
            reader.forget_locations()
            hit = reader.locate(keys, lease=True)
            reader.forget_locations()
            longer = reader.locate([*keys, f"s{i}/new-a", f"s{i}/new-b"])  # partly cached
            reader.forget_locations()
            fresh = reader.locate([SYSTEM, f"new-{i}/1", f"new-{i}/2"])  # only page 0 stored
            # The shared page is found only where a home of the new anchor holds it itself.
            assert (hit.pages, longer.pages, min(fresh.pages, 1)) == (PAGES, PAGES, fresh.pages)
            assert max(hit.nodes_asked, longer.nodes_asked) <= 3
            assert fresh.nodes_asked <= 2 and fresh.actor_calls <= 2
        assert reader.stats(nodes=False)["client"]["fanouts"] == 0


def test_after_a_node_joins_moved_chains_are_found_and_re_recorded(scale):
    writer, service = scale["writer"], scale["service"]
    before = node_ids(writer)
    service.cluster.add_node(num_cpus=0, resources={RESOURCE: 1})
    service.cluster.wait_for_nodes()
    deploy.start(service.config, resource=RESOURCE)
    wait_for("the ninth storage node", lambda: len(node_ids(writer)) == NODES + 1)
    (newcomer,) = set(node_ids(writer)) - set(before)
    moved = [
        f"c{i}"
        for i in range(CHAINS)
        if home_candidates(_first(f"c{i}"), node_ids(writer))[0] == newcomer
    ]
    assert moved, "no chain's home moved to the new node (48 chains, 1/9 each)"
    assert all(home_record(writer, newcomer, name) is None for name in moved)
    reports = lookups({f"c{i}": True for i in range(CHAINS)})
    assert_bounded(reports)
    for name in moved:  # the lookups told the new home where the chain lives
        owner = writer.locate(chain(name)).node_id
        wait_for(
            f"{name} re-recorded", lambda n=name, o=owner: home_record(writer, newcomer, n) == o
        )


def test_after_a_node_leaves_its_chains_miss_and_the_rest_are_found(scale):
    writer = scale["writer"]
    owners = {f"c{i}": writer.locate(chain(f"c{i}")).node_id for i in range(CHAINS)}
    leaver = max(set(owners.values()), key=lambda node: list(owners.values()).count(node))
    description = writer.nodes.require(leaver).description
    ray.kill(ray.get_actor(node_actor_name(description.ray_node_id), namespace=NAMESPACE))
    wait_for("the node to leave", lambda: leaver not in node_ids(writer))
    survivors = node_ids(writer)
    homed = [n for n in owners if home_candidates(_first(n), [*survivors, leaver])[0] == leaver]
    reports = lookups({name: owner != leaver for name, owner in owners.items()})
    assert_bounded(reports)
    assert reports["lost"] and homed  # chains it held miss; chains it was home to are found


def test_a_restarted_home_still_knows_its_chains(scale):
    writer = scale["writer"]
    ids = node_ids(writer)
    located = {f"c{i}": writer.locate(chain(f"c{i}")).node_id for i in range(CHAINS)}
    owners = {name: owner for name, owner in located.items() if owner is not None}
    records = {  # (home, chain) pairs where the home is not the owner: it holds a record
        (home, name)
        for name, owner in owners.items()
        for home in home_candidates(_first(name), ids)
        if home != owner
    }
    home = max(ids, key=lambda node: sum(1 for h, _ in records if h == node))
    known = [name for h, name in records if h == home]
    assert known and all(home_record(writer, home, name) == owners[name] for name in known)
    link = writer.nodes.require(home)
    actor = ray.get_actor(node_actor_name(link.description.ray_node_id), namespace=NAMESPACE)
    ray.kill(actor, no_restart=False)
    epoch = link.description.started_at
    wait_for("the home to restart", lambda: ray.get(actor.describe.remote(None)).started_at > epoch)
    writer.nodes.refresh(force=True)
    assert all(home_record(writer, home, name) == owners[name] for name in known)
