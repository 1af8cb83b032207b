"""Tenants of one store: their own keys, geometry and quotas over shared media."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.tenants import Tenant, check_tenant_name, new_secret, secret_hash
from flatcake_ray.errors import QuotaExceededError, TenantError
from tests.conftest import LAYERS, PAGE_BYTES, random_kv

DRAM = PutHints(turn=2, prior_reply_tokens=1)


def tenant(name: str, layers: int = LAYERS, page_bytes: int = PAGE_BYTES, **quotas) -> Tenant:
    return Tenant(name, secret_hash(new_secret()), layers, page_bytes, **quotas)


def test_tenants_never_see_each_others_pages(make_store):
    store = make_store()
    store.set_tenant(tenant("alpha"))
    store.set_tenant(tenant("beta"))
    kv = random_kv(6, seed=1)
    store.put(list(range(6)), kv, tenant="alpha")
    assert store.exists(list(range(6)), tenant="alpha") == 6
    assert store.exists(list(range(6)), tenant="beta") == 0  # same keys, another tenant
    assert store.exists(list(range(6))) == 0  # nor the default tenant
    out = np.zeros_like(kv)
    assert store.get(list(range(6)), out, tenant="beta") == 0 and not out.any()
    assert store.get(list(range(6)), out, tenant="alpha") == 6 and np.array_equal(out, kv)


def test_each_tenant_has_its_own_model_geometry(make_store):
    store = make_store()
    store.set_tenant(tenant("small", layers=2, page_bytes=4096))
    small = np.random.default_rng(2).integers(0, 256, (2, 5, 4096), dtype=np.uint8)
    store.put(list(range(5)), small, tenant="small")
    store.put(list(range(5)), random_kv(5, seed=3))  # the default tenant's geometry
    out = np.zeros_like(small)
    assert store.get(list(range(5)), out, tenant="small") == 5 and np.array_equal(out, small)
    with pytest.raises(TenantError, match="holds pages"):
        store.set_tenant(tenant("small", layers=3, page_bytes=4096))


def test_a_tenant_over_quota_reclaims_its_own_scopes_never_anothers(make_store):
    store = make_store(dram_bytes=4 << 20)
    session = LAYERS * 4 * PAGE_BYTES  # one 4-page session a DRAM scope of 128 KiB
    store.set_tenant(tenant("noisy", quota_dram=3 * session))
    store.set_tenant(tenant("quiet"))
    store.put([f"q{i}" for i in range(4)], random_kv(4, seed=4), tenant="quiet", hints=DRAM)
    for s in range(8):  # far more than its quota: it evicts its own oldest sessions
        keys = [f"n{s}-{i}" for i in range(4)]
        store.put(keys, random_kv(4, seed=10 + s), tenant="noisy", hints=DRAM, session_id=s)
    assert store.exists([f"q{i}" for i in range(4)], tenant="quiet") == 4
    noisy = store.stats()["tenants"]["noisy"]
    assert noisy["dram_used"] <= 3 * session and noisy["reclaimed_scopes"] >= 5
    assert store.exists([f"n7-{i}" for i in range(4)], tenant="noisy") == 4  # the newest stays


def test_a_put_beyond_every_quota_is_a_typed_error_and_evicts_nothing(make_store):
    store = make_store()
    store.set_tenant(tenant("tight", quota_dram=0, quota_ssd=64 << 10))
    store.put(["a"], random_kv(1, seed=5), tenant="tight")  # 32 KiB: fits
    with pytest.raises(QuotaExceededError, match="tight"):
        store.put([f"b{i}" for i in range(8)], random_kv(8, seed=6), tenant="tight")
    assert store.exists(["a"], tenant="tight") == 1  # nothing of its own was lost either
    assert store.stats()["tenants"]["tight"]["reclaimed_scopes"] == 0


def test_unknown_tenants_and_names_are_typed_errors(make_store):
    store = make_store()
    with pytest.raises(TenantError, match="no tenant"):
        store.exists([1], tenant="nobody")
    with pytest.raises(TenantError):
        check_tenant_name("has/slash")


@given(st.one_of(st.none(), st.integers(), st.text(max_size=300), st.binary(max_size=40)))
def test_a_malformed_secret_is_a_typed_error(secret):
    if isinstance(secret, str) and 16 <= len(secret) <= 256:
        assert len(secret_hash(secret)) == 64
    else:
        with pytest.raises(TenantError):
            secret_hash(secret)


def test_a_restarted_store_brings_every_tenant_back(make_store):
    store = make_store()
    store.set_tenant(tenant("alpha", layers=2, page_bytes=4096))
    kv = np.random.default_rng(7).integers(0, 256, (2, 3, 4096), dtype=np.uint8)
    store.put(["x", "y", "z"], kv, tenant="alpha")  # a first turn: SSD, in the manifest
    config = store.config
    store.close()
    reopened = make_store(**{f: getattr(config, f) for f in ("dram_bytes", "ssd_file_bytes")})
    out = np.zeros_like(kv)
    assert reopened.get(["x", "y", "z"], out, tenant="alpha") == 3 and np.array_equal(out, kv)
    assert reopened.stats()["tenants"]["alpha"]["pages_indexed"] == 3
