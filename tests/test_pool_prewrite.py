"""An SSD pool's never-written space written once in the background (``ssd_prewrite``),
never over the data written meanwhile."""

from __future__ import annotations

import errno
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatcake_ray import failpoints as fp
from flatcake_ray.errors import ConfigError
from flatcake_ray.media.pool import SsdPool
from flatcake_ray.media.pool_prewrite import unwritten_ranges
from flatcake_ray.metrics.definitions import BY_NAME
from flatcake_ray.metrics.view import collapse, format_view, status_view
from tests.conftest import LAYERS, PAGE_BYTES, random_kv

FILE_BYTES = 1 << 20
BLOCK = 4096
STEP = 64 << 10


def _reports_unwritten(folder) -> bool:
    """Whether the file system here reports fallocated space as holes (ext4, XFS do)."""
    path = os.path.join(folder, "probe")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, 1 << 20)
        return unwritten_ranges(fd, 1 << 20) == [(0, 1 << 20)]
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.fixture
def folder(tmp_path):
    if not _reports_unwritten(tmp_path):
        pytest.skip(f"{tmp_path}'s file system reports no unwritten extents (nothing to prewrite)")
    return tmp_path


def _block(seed: int) -> np.ndarray:
    """One 4 KiB page-aligned block of seeded bytes (O_DIRECT writes from aligned memory)."""
    raw = np.empty(2 * BLOCK, np.uint8)
    start = -raw.ctypes.data % BLOCK
    block = raw[start : start + BLOCK]
    block[:] = np.random.default_rng(seed).integers(1, 256, BLOCK, dtype=np.uint8)
    return block


def _read(pool: SsdPool, offset: int) -> np.ndarray:
    out = _block(0)
    pool.read_into(*pool.locate(offset), out)
    return out


def _settle(pool: SsdPool, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pool.prewrite is not None and not pool.prewrite.done:
        assert time.monotonic() < deadline, "the prewrite did not finish"
        time.sleep(0.005)


@contextmanager
def _opened(*folders, files: int = 2, prewrite: bool = True) -> Iterator[SsdPool]:
    """A pool of ``files`` files per folder, prewriting in ``STEP`` steps; closed after."""
    # Unpaced: these tests race writers against the steps; waiting for an idle drive (the
    # disk other jobs here share) only slows them (pacing: tests/test_drive_activity.py).
    pool = SsdPool(
        tuple(map(str, folders)),
        files,
        FILE_BYTES,
        prewrite=prewrite,
        prewrite_step=STEP,
        prewrite_paced=False,
    )
    try:
        yield pool
    finally:
        pool.close()


def _holes(pool: SsdPool) -> list[list[tuple[int, int]]]:
    return [unwritten_ranges(fd, pool.file_bytes) for fd in pool.fds]


def test_a_prewritten_pool_has_no_unwritten_space(folder):
    with _opened(folder) as pool:
        assert pool.prewrite_pending <= 2 * FILE_BYTES
        _settle(pool)
        assert _holes(pool) == [[], []]
        assert (pool.prewrite_pending, pool.prewrite_error) == (0, "")


def test_without_prewrite_the_space_stays_unwritten(folder):
    with _opened(folder, prewrite=False) as pool:
        assert _holes(pool) == [[(0, FILE_BYTES)], [(0, FILE_BYTES)]]
        assert pool.prewrite_pending == 0


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    blocks=st.lists(
        st.integers(0, 2 * FILE_BYTES // BLOCK - 1), min_size=1, max_size=40, unique=True
    ),
    writers=st.integers(1, 3),
    drives=st.integers(1, 2),
)
def test_data_written_while_prewriting_is_never_zeroed(folder, blocks, writers, drives):
    """Writes race the prewriter (its steps slowed by a failpoint; one drive, or two written
    at once); every block written reads back its bytes, and the rest of the pool ends
    written (no unwritten space left)."""
    fp.arm("pool.prewrite", call=lambda **_: time.sleep(0.001), times=None)
    try:
        with tempfile.TemporaryDirectory(dir=folder) as where:
            folders = [os.path.join(where, f"drive{d}") for d in range(drives)]
            with _opened(*folders, files=2 // drives) as pool:
                share = [blocks[i::writers] for i in range(writers)]
                threads = [
                    threading.Thread(
                        target=lambda mine: [pool.write(b * BLOCK, _block(b + 1)) for b in mine],
                        args=(mine,),
                    )
                    for mine in share
                ]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                _settle(pool)
                for b in blocks:
                    assert np.array_equal(_read(pool, b * BLOCK), _block(b + 1)), b
                assert _holes(pool) == [[], []]
    finally:
        fp.disarm_all()


def test_a_failed_prewrite_says_why_and_the_pool_stays_usable(folder, failpoints):
    failpoints.arm("pool.prewrite", raises=OSError(errno.EIO, "injected"), times=1, skip=2)
    with _opened(folder) as pool:
        _settle(pool)
        assert "injected" in pool.prewrite_error
        assert pool.prewrite_pending == 2 * FILE_BYTES - 2 * STEP
        pool.write(FILE_BYTES + 8 * BLOCK, _block(7))
        assert np.array_equal(_read(pool, FILE_BYTES + 8 * BLOCK), _block(7))


def test_a_reopened_pool_prewrites_the_rest_and_keeps_its_data(folder, failpoints):
    failpoints.arm("pool.prewrite", raises=OSError(errno.EIO, "injected"), times=1, skip=3)
    with _opened(folder) as pool:
        _settle(pool)
        assert pool.prewrite_error
        pool.write(FILE_BYTES - BLOCK, _block(3))  # in space the first prewrite never reached
    with _opened(folder, prewrite=False) as holes:
        left = _holes(holes)
    assert left[0] == [(3 * STEP, FILE_BYTES - BLOCK)] and left[1] == [(0, FILE_BYTES)]
    # Its first step held until the count is read: the prewriter starts as the pool opens.
    opened = threading.Event()
    failpoints.arm("pool.prewrite", call=lambda **_: opened.wait(10), times=1)
    with _opened(folder) as pool:
        assert pool.prewrite_pending == FILE_BYTES - 3 * STEP - BLOCK + FILE_BYTES
        opened.set()
        _settle(pool)
        assert _holes(pool) == [[], []] and not pool.prewrite_error
        assert np.array_equal(_read(pool, FILE_BYTES - BLOCK), _block(3))


def test_a_store_prewrites_its_pool_when_configured(folder, make_store):
    store = make_store(ssd_prewrite=True)
    deadline = time.monotonic() + 30
    while store.stats()["ssd_prewrite_pending"]:
        assert time.monotonic() < deadline, "the store's prewrite did not finish"
        time.sleep(0.01)
    assert store.stats()["ssd_prewrite_error"] == ""
    assert _holes(store.pool) == [[] for _ in store.pool.fds]
    kv = random_kv(12)
    assert store.put(list(range(12)), kv).medium.name == "SSD"
    out = np.zeros((LAYERS, 12, PAGE_BYTES), dtype=np.uint8)
    assert store.get(list(range(12)), out) == 12 and np.array_equal(out, kv)


def test_a_store_leaves_its_pool_alone_by_default(folder, make_store):
    store = make_store()
    assert store.stats()["ssd_prewrite_pending"] == 0
    assert "still to prewrite" not in format_view(status_view(store.metrics.samples()))
    assert all(holes for holes in _holes(store.pool))


@pytest.mark.parametrize("step", [0, -4096, 4096 + 512])
def test_a_step_that_is_not_whole_blocks_is_refused_and_opens_nothing(tmp_path, step):
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ConfigError, match="prewrite step"):
        SsdPool((str(tmp_path),), 1, FILE_BYTES, prewrite=True, prewrite_step=step)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_store_reports_a_stopped_prewrite_in_stats_and_metrics(folder, make_store, failpoints):
    failpoints.arm("pool.prewrite", raises=OSError(errno.EIO, "injected"), times=1)
    store = make_store(ssd_prewrite=True)
    _settle(store.pool)
    stats = store.stats()
    assert "injected" in stats["ssd_prewrite_error"]
    assert (
        stats["ssd_prewrite_pending"]
        == store.config.ssd_files_per_dir * store.config.ssd_file_bytes
    )
    series = BY_NAME["flatcake_ssd_prewrite_pending_bytes"].exported
    gauge = [s.value for s in collapse(store.metrics.samples()) if s.name == series]
    assert gauge == [stats["ssd_prewrite_pending"]]
    view = status_view(store.metrics.samples())
    row = next(r for r in view["nodes"] if r["node_id"] == str(store.config.node_id))
    assert row["ssd_prewrite_pending_bytes"] == stats["ssd_prewrite_pending"]
    assert "still to prewrite" in format_view(view)


def test_the_drives_of_a_pool_are_prewritten_at_once(folder, failpoints):
    active, most, lock = [0], [0], threading.Lock()

    def step(**_):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.01)
        with lock:
            active[0] -= 1

    failpoints.arm("pool.prewrite", call=step, times=None)
    with _opened(folder / "drive0", folder / "drive1", files=1) as pool:
        _settle(pool)
        assert most[0] == 2 and _holes(pool) == [[], []]
