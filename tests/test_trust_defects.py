"""Defects an adversarial user found through the in-process store's public API (issue 11's
"Why"), each reproduced here: a second opener of a root, no space at open, a lease whose
scope went under it, a manifest write that fails inside a put, and inputs that used to get
untyped errors. Those found through the actors are in ``tests/test_fuzz_actors.py`` and
``tests/test_tenant_service.py``; docs/security.md lists which test holds which."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import numpy as np
import pytest

from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.tenants import Tenant, secret_hash
from flatcake_ray.errors import (
    InvalidKeyError,
    MediumFullError,
    ShapeError,
    StoreInUseError,
    StoreWriteError,
)
from flatcake_ray.node.store import FlatCakeStore
from tests.conftest import LAYERS, PAGE_BYTES, random_kv, small_config

SSD = PutHints(turn=1)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_second_opener_of_a_root_gets_a_typed_error(tmp_path):
    config = small_config(tmp_path)
    opener = (
        "import sys\n"
        "from flatcake_ray.config import StoreConfig\n"
        "from flatcake_ray.errors import StoreInUseError\n"
        "from flatcake_ray.node.store import FlatCakeStore\n"
        "try:\n"
        "    FlatCakeStore(StoreConfig(root=sys.argv[1], layers=4, page_bytes=8192,\n"
        "        dram_bytes=4 << 20, ssd_file_bytes=8 << 20, ssd_files_per_dir=2, fsync=False))\n"
        "except StoreInUseError:\n"
        "    sys.exit(7)\n"
    )
    with FlatCakeStore(config) as first:
        first.put(["a", "b"], random_kv(2), hints=SSD)
        with pytest.raises(StoreInUseError):  # this process
            FlatCakeStore(config)
        other = subprocess.run(  # another process: what lost 20-40 sessions
            [sys.executable, "-c", opener, str(tmp_path)], capture_output=True, timeout=120
        )
        assert other.returncode == 7, other.stderr.decode()[-2000:]
        assert first.exists(["a", "b"]) == 2
    with FlatCakeStore(config) as again:  # closing released the lock
        assert again.exists(["a", "b"]) == 2


def test_no_space_at_open_is_a_typed_error_and_leaves_nothing_behind(tmp_path, failpoints):
    config = small_config(tmp_path)
    fds = open_fds()
    point = failpoints.arm(
        "pool.allocate", raises=OSError(errno.ENOSPC, "No space left on device"), skip=1
    )
    with pytest.raises(MediumFullError, match="cannot allocate"):
        FlatCakeStore(config)  # the second pool file does not fit
    assert point.fired == 1
    assert open_fds() == fds  # no pool file, lock or arena (memfd) descriptor left open
    with FlatCakeStore(config) as store:  # and the root is not left locked
        store.put(["a"], random_kv(1), hints=SSD)
        assert store.exists(["a"]) == 1


def test_a_lease_whose_scope_went_meanwhile_answers_false(make_store):
    store = make_store()
    store.set_tenant(Tenant("gone", secret_hash("g" * 32), LAYERS, PAGE_BYTES))
    store.put(["p0", "p1"], random_kv(2), tenant="gone")
    lease = store.lease(["p0", "p1"], tenant="gone")
    assert lease.hits == 2
    store.remove_tenant("gone")  # its scopes are freed while the lease is held
    assert store.release(lease) is False  # so what a reader copied under it is dropped
    kept = store.lease(["p0"])  # another tenant's lease is untouched by all this
    assert kept.hits == 0 and store.release(kept) is True


def test_a_manifest_write_failing_inside_a_put_publishes_nothing_and_restarts_clean(
    tmp_path, failpoints
):
    config = small_config(tmp_path)
    keys, kv = [f"m{i}" for i in range(6)], random_kv(6, seed=3)
    with FlatCakeStore(config) as store:
        store.put(["before"], random_kv(1, seed=1), hints=SSD)
        used = store.stats()["ssd_used"]
        failpoints.arm("manifest.append", raises=OSError(errno.EIO, "Input/output error"))
        with pytest.raises(StoreWriteError):
            store.put(keys, kv, hints=SSD)
        assert store.exists(keys) == 0  # never visible, so never half-kept
        assert store.stats()["ssd_used"] == used  # its space came back
        assert store.put(keys, kv, hints=SSD).pages_written == 6  # retried
    with FlatCakeStore(config) as reopened:  # the restart keeps exactly what was committed
        assert reopened.exists(["before"]) == 1
        out = np.zeros((LAYERS, 6, PAGE_BYTES), dtype=np.uint8)
        assert reopened.get(keys, out) == 6 and np.array_equal(out, kv)


def test_keys_in_a_generator_or_a_string_are_typed_errors(make_store):
    store = make_store()
    with pytest.raises(InvalidKeyError, match="list or tuple"):
        store.put((f"k{i}" for i in range(2)), random_kv(2))
    with pytest.raises(InvalidKeyError, match="list or tuple"):
        store.begin_put(iter(["k0"]))
    with pytest.raises(InvalidKeyError, match="list or tuple"):
        store.exists("k0k1")  # one key per character, before
    assert store.stats()["scopes"] == 0


def test_hints_of_another_type_are_a_typed_error(make_store):
    store = make_store()
    with pytest.raises(ShapeError, match="PutHints"):
        store.put(["a", "b"], random_kv(2), hints="fast")
    assert store.exists(["a"]) == 0


def test_an_empty_key_list_says_so(make_store):
    store = make_store()
    with pytest.raises(ShapeError, match="at least one key"):
        store.put([], np.zeros((LAYERS, 0, PAGE_BYTES), dtype=np.uint8))
    with pytest.raises(ShapeError, match="at least one key"):
        store.begin_put([])


def test_a_put_handle_used_after_its_store_closed_is_a_typed_error(tmp_path):
    store = FlatCakeStore(small_config(tmp_path))
    handle = store.begin_put(["late"])
    handle.write_layer(0, random_kv(1)[0])
    store.close()  # aborts the puts still open
    with pytest.raises(StoreWriteError):
        handle.write_layer(1, random_kv(1)[1])
    with pytest.raises(StoreWriteError):
        handle.commit()
    with FlatCakeStore(small_config(tmp_path)) as reopened:
        assert reopened.exists(["late"]) == 0
