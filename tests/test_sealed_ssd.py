"""A tenant's SSD pages lie sealed on the drive (issue 23: pool files have paths, and any
process of the service's OS user can open them), and come back plain to its own readers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.tenants import Tenant, new_secret, seal_key, secret_hash
from flatcake_ray.errors import StoreWriteError
from tests.conftest import LAYERS, PAGE_BYTES, lines_found, marked_kv

SSD = PutHints(turn=1)  # a first turn: the placement puts it on SSD


def _tenant(store, name: str) -> str:
    secret = new_secret()
    store.set_tenant(Tenant(name, secret_hash(secret), LAYERS, PAGE_BYTES))
    store.tenancy.learn_seal(name, seal_key(secret))  # what a storage node does on a call
    return secret


def _stored(store, pages: int, seed: int) -> tuple[str, list[str], np.ndarray]:
    """Tenant alpha, its key learnt, with ``pages`` marked pages put on SSD: its secret,
    keys and pages."""
    secret = _tenant(store, "alpha")
    kv = marked_kv(pages, seed=seed)
    keys = [f"k{i}" for i in range(pages)]
    store.put(keys, kv, tenant="alpha", hints=SSD)
    return secret, keys, kv


def _reopened(make_store, store):
    """``store`` closed and opened again on its root (a node restart)."""
    config = store.config
    store.close()
    return make_store(**{f: getattr(config, f) for f in ("dram_bytes", "ssd_file_bytes")})


def _pool_bytes(store) -> bytes:
    return b"".join(Path(p).read_bytes() for p in store.pool.paths)


def test_a_tenants_ssd_pages_lie_sealed_and_restore_plain(make_store):
    store = make_store()
    _, keys, kv = _stored(store, 12, seed=3)
    assert store.stats()["tenants"]["alpha"]["ssd_used"] > 0
    assert lines_found(kv, _pool_bytes(store)) == 0  # none of its bytes, by path
    out = np.zeros_like(kv)
    assert store.get(keys, out, tenant="alpha") == 12
    assert np.array_equal(out, kv)


def test_a_tenant_without_a_secret_writes_plain(make_store):
    """The default tenant of an open service has no secret, so no key: nothing to seal
    against (every job is that tenant)."""
    store = make_store()
    kv = marked_kv(6, seed=4)
    store.put([f"p{i}" for i in range(6)], kv, hints=SSD)
    assert lines_found(kv, _pool_bytes(store)) > 0


def test_a_reader_without_the_key_misses_and_quarantines_nothing(make_store):
    store = make_store()
    _, keys, kv = _stored(store, 8, seed=5)
    reopened = _reopened(make_store, store)
    out = np.zeros_like(kv)
    assert reopened.get(keys, out, tenant="alpha") == 0  # sealed, and no caller told the key
    assert not out.any()
    assert reopened.stats()["tenants"]["alpha"]["pages_indexed"] == 8  # nothing quarantined


def test_sealed_pages_come_back_after_a_restart_to_the_tenants_key(make_store):
    store = make_store()
    secret, keys, kv = _stored(store, 8, seed=6)
    reopened = _reopened(make_store, store)
    reopened.tenancy.learn_seal("alpha", seal_key(secret))
    out = np.zeros_like(kv)
    assert reopened.get(keys, out, tenant="alpha") == 8 and np.array_equal(out, kv)


def test_another_key_reads_no_wrong_byte(make_store):
    store = make_store()
    _, keys, kv = _stored(store, 8, seed=7)
    store.tenancy.learn_seal("alpha", seal_key(new_secret()))  # a wrong key
    out = np.zeros_like(kv)
    got = store.get(keys, out, tenant="alpha")
    assert got == 0 and not out.any()


def test_a_sealed_write_that_fails_publishes_nothing(make_store, failpoints):
    """A drive error on any piece of a sealed layer (written several at once) fails the put
    with its typed error once every piece in flight has ended; the space goes back."""
    store = make_store(ssd_file_bytes=64 << 20)
    _tenant(store, "alpha")
    kv = marked_kv(1200, seed=9)  # layers of 9.4 MiB: three pieces each
    keys = [f"k{i}" for i in range(1200)]
    failpoints.arm("pool.write", raises=OSError(5, "injected I/O error"), times=None)
    with pytest.raises(StoreWriteError):
        store.put(keys, kv, tenant="alpha", hints=SSD)
    failpoints.disarm("pool.write")
    assert store.exists(keys, tenant="alpha") == 0
    store.put(keys, kv, tenant="alpha", hints=SSD)
    out = np.zeros_like(kv)
    assert store.get(keys, out, tenant="alpha") == 1200 and np.array_equal(out, kv)
