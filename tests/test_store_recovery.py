"""What the single-node store keeps and gives up: leased scopes survive reclamation, SSD is
reclaimed oldest first, a flipped byte is a miss that quarantines, and a reopened store
recovers its SSD index (or refuses another geometry)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from flatcake_ray.errors import ConfigError, MediumFullError
from flatcake_ray.node.store import FlatCakeStore
from flatcake_ray.restore import PagedPool
from tests.conftest import LAYERS, PAGE_BYTES, random_kv, small_config
from tests.test_store import SHORT_CHAT, restore


def test_leased_scopes_survive_reclamation(make_store):
    store = make_store(dram_bytes=1 << 20, high_watermark=0.5, low_watermark=0.3)
    kv = random_kv(4)  # 128 KiB a session
    store.put(["old-0", "old-1", "old-2", "old-3"], kv, hints=SHORT_CHAT)
    store.put(["held-0", "held-1", "held-2", "held-3"], kv, hints=SHORT_CHAT)
    lease = store.lease(["held-0", "held-1", "held-2", "held-3"])
    for i in range(6):
        store.put([f"new-{i}-{p}" for p in range(4)], kv, hints=SHORT_CHAT)
    assert store.exists(["old-0"]) == 0  # oldest unreferenced: freed whole
    assert store.exists(["held-0", "held-1", "held-2", "held-3"]) == 4
    out = np.zeros((LAYERS, 4, PAGE_BYTES), dtype=np.uint8)
    dest = PagedPool(out, np.arange(4))
    assert store.restore_lease(lease, dest).wait() == 4
    assert np.array_equal(out, kv)
    store.release(lease)
    assert store.stats()["reclaimed_scopes"] >= 1


def test_full_medium_with_nothing_reclaimable_is_a_typed_error(make_store):
    store = make_store(dram_bytes=0, ssd_file_bytes=1 << 20, ssd_files_per_dir=1)
    store.put(["a"], random_kv(1))
    lease = store.lease(["a"])
    with pytest.raises(MediumFullError):
        store.put([f"big-{i}" for i in range(200)], random_kv(200))
    assert store.exists(["a"]) == 1
    store.release(lease)


def test_flipped_byte_on_disk_is_a_miss_and_quarantines(make_store):
    store = make_store()
    kv = random_kv(4, seed=7)
    store.put(list(range(4)), kv)
    file_index, offset = store.pool.locate(int(store.gvas([2])[0]) & ((1 << 48) - 1))
    with open(store.pool.paths[file_index], "r+b") as pool_file:
        pool_file.seek(offset + 100)
        byte = pool_file.read(1)
        pool_file.seek(offset + 100)
        pool_file.write(bytes([byte[0] ^ 0xFF]))
    count, _ = restore(store, list(range(4)))
    assert count == 0
    assert store.exists(list(range(4))) == 0
    assert store.stats()["quarantined_scopes"] == 1


def test_reopened_store_recovers_its_ssd_index(tmp_path):
    kv = random_kv(8, seed=8)
    with FlatCakeStore(small_config(tmp_path)) as store:
        store.put(list(range(4)), kv[:, :4])
        store.put(list(range(8)), kv)
        store.put(["dram"], kv[:, :1], hints=SHORT_CHAT)
    with FlatCakeStore(small_config(tmp_path)) as reopened:
        count, out = restore(reopened, list(range(8)))
        assert count == 8 and np.array_equal(out, kv)
        assert reopened.exists(["dram"]) == 0  # DRAM is gone after a restart, by design
        assert reopened.put(list(range(9)), random_kv(9)).pages_written == 1
        assert reopened.exists(list(range(9))) == 9


ONE_MIB_POOL = dict(ssd_file_bytes=1 << 20, ssd_files_per_dir=1, ssd_min_run_bytes=128 << 10)


def test_ssd_is_reclaimed_on_demand_oldest_first(make_store):
    store = make_store(**ONE_MIB_POOL)
    kv = random_kv(4)  # 128 KiB a segment: the pool holds 8
    for session in range(8):
        store.put([f"s{session}-{p}" for p in range(4)], kv)
    assert store.stats()["reclaimed_scopes"] == 0  # full, but nothing freed ahead
    store.exists(["s0-0"])  # a lookup is not a use: s0 stays the oldest
    store.release(store.lease(["s1-0", "s1-1"]))  # a lease is: s1 moves to the back
    store.put([f"s8-{p}" for p in range(4)], kv)
    store.put([f"s9-{p}" for p in range(4)], kv)
    assert store.stats()["reclaimed_scopes"] == 2  # one scope per put, no more
    kept = [s for s in range(10) if store.exists([f"s{s}-0"])]
    assert kept == [1, 3, 4, 5, 6, 7, 8, 9]


def test_reclaimed_ssd_scopes_stay_gone_after_restart(tmp_path):
    config = dict(**ONE_MIB_POOL, ssd_high_watermark=0.6, ssd_low_watermark=0.4)
    kv = random_kv(4)  # 128 KiB a segment
    with FlatCakeStore(small_config(tmp_path, **config)) as store:
        for session in range(8):
            store.put([f"s{session}-{p}" for p in range(4)], kv)
        survivors = [s for s in range(8) if store.exists([f"s{s}-0"])]
        assert 0 < len(survivors) < 8 and store.stats()["reclaimed_scopes"] > 0
    with FlatCakeStore(small_config(tmp_path, **config)) as reopened:
        assert [s for s in range(8) if reopened.exists([f"s{s}-0"])] == survivors
        for s in survivors:
            count, out = restore(reopened, [f"s{s}-{p}" for p in range(4)])
            assert count == 4 and np.array_equal(out, kv)


def test_torn_manifest_tail_is_dropped(tmp_path):
    kv = random_kv(2)
    with FlatCakeStore(small_config(tmp_path)) as store:
        store.put(["a", "b"], kv)
        store.put(["c"], kv[:, :1])
        manifest = store.manifest.path
    data = manifest.read_bytes()
    manifest.write_bytes(data[:-7])  # a crash mid-append of the last record
    with FlatCakeStore(small_config(tmp_path)) as reopened:
        assert reopened.exists(["a", "b"]) == 2 and reopened.exists(["c"]) == 0


def test_changed_geometry_is_refused(tmp_path):
    FlatCakeStore(small_config(tmp_path)).close()
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(ConfigError):
        FlatCakeStore(small_config(tmp_path, page_bytes=4096))
    # The refused open created an arena of its own before reading the manifest: it must be
    # gone with the error (its memfds closed), or every refused open leaks its memory.
    assert set(os.listdir("/proc/self/fd")) == fds
