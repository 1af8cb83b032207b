"""The default tenant and the per-tenant limits through the live service: the open default
tenant serves until the first named tenant is added, then refuses; a tenant over its call
rate, its leases or its open puts gets :class:`TenantLimitError` from the node (and from its
client), the other tenants do not, and nothing stored is lost."""

from __future__ import annotations

import numpy as np
import pytest

from flatcake_ray.core.catalog import PutHints
from flatcake_ray.errors import AccessDeniedError, TenantLimitError
from tests.conftest import LAYERS, PAGE_BYTES, SMALL_SERVICE
from tests.conftest import random_kv as kv
from tests.test_tenant_service import keys

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

NAMESPACE = "fc-tenant-limits"
SSD = PutHints(turn=1)
BURST = 60  # calls each tenant may make here, ever (the rate refills one in 1000 s)


@pytest.fixture(scope="module")
def service(ray_service):
    ray_service(
        NAMESPACE,
        **SMALL_SERVICE,
        landing_bytes=4 << 20,
        ramp_seconds=0.0,
        tenant_calls_per_s=0.001,
        tenant_call_burst=BURST,
        tenant_leases=2,
        tenant_puts=1,
    )
    return {}


def client_of(secret: str | None):
    from flatcake_ray.client.client import FlatCakeClient
    from flatcake_ray.config import ClientConfig

    return FlatCakeClient(NAMESPACE, config=ClientConfig(tenant_secret=secret or ""))


def add(name: str) -> str:
    from flatcake_ray.client import tenants

    return tenants.add_tenant(NAMESPACE, name, layers=LAYERS, page_bytes=PAGE_BYTES, timeout_s=60.0)


def node_of(client):
    return ray.get_actor(client.nodes.links[1].description.actor_name, NAMESPACE)


def test_the_default_tenant_serves_until_a_named_tenant_is_added(service):
    default = client_of(None)
    default.put(keys("d", 2), kv(2, 1), hints=SSD)
    assert default.exists(keys("d", 2)) == 2
    node = node_of(default)
    service["alpha"] = add("alpha")  # the table is pushed to every node at once
    with pytest.raises(AccessDeniedError, match="named tenants"):
        ray.get(node.exists.remote(None, keys("d", 2)), timeout=30)
    with pytest.raises(AccessDeniedError):
        default.exists(keys("d", 2))
    default.close()
    with pytest.raises(AccessDeniedError):
        client_of(None)


def test_a_tenant_over_its_leases_or_puts_is_refused_and_loses_nothing(service):
    alpha = client_of(service["alpha"])
    kept = kv(3, 2)
    alpha.put(keys("a", 3), kept, hints=SSD)
    node, secret = node_of(alpha), service["alpha"]
    held = [ray.get(node.lookup.remote(secret, keys("a", 3)), timeout=30) for _ in range(2)]
    assert [reply.hits for reply in held] == [3, 3]
    with pytest.raises(TenantLimitError, match="tenant_leases=2"):
        ray.get(node.lookup.remote(secret, keys("a", 3)), timeout=30)
    out = np.zeros_like(kept)
    with pytest.raises(TenantLimitError):  # its client says so too, and keeps the node up
        alpha.get(keys("a", 3), out)
    assert all(ray.get(node.release.remote(secret, r.lease_id), timeout=30) for r in held)

    ticket = ray.get(node.begin_put.remote(secret, keys("p", 1)), timeout=30)
    with pytest.raises(TenantLimitError, match="tenant_puts=1"):
        ray.get(node.begin_put.remote(secret, keys("q", 1)), timeout=30)
    ray.get(node.abort_put.remote(secret, ticket.put_id), timeout=30)
    assert alpha.get(keys("a", 3), out) == 3 and np.array_equal(out, kept)  # nothing lost
    stats = ray.get(node.stats.remote(secret), timeout=30)
    assert stats["leases_limited"] >= 2 and stats["puts_limited"] == 1
    alpha.close()


def test_a_tenant_over_its_call_rate_is_refused_and_another_is_served(service):
    hog, calm = add("hog"), add("calm")
    calm_client = client_of(calm)
    calm_client.put(keys("c", 2), kv(2, 3), hints=SSD)
    node = node_of(calm_client)
    refused = 0
    for _ in range(BURST + 1):
        try:
            ray.get(node.exists.remote(hog, keys("c", 2)), timeout=30)
        except TenantLimitError:
            refused += 1
    assert refused == 1
    with pytest.raises(TenantLimitError, match="call rate"):
        ray.get(node.exists.remote(hog, keys("c", 2)), timeout=30)
    assert ray.get(node.release.remote(hog, 12345), timeout=30) is False  # give-backs pass
    out = np.zeros((LAYERS, 2, PAGE_BYTES), dtype=np.uint8)
    assert calm_client.get(keys("c", 2), out) == 2 and np.array_equal(out, kv(2, 3))
    calm_client.close()
