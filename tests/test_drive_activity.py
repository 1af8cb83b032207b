"""A pool's prewrite takes its drive's idle time: it waits while others read or write the
drive (``media/drive_activity.py``), and still finishes on a drive that is never idle.

The drive's counters are a block device's ``stat`` file; here a file of the same format the
test writes (the real one moves with every other job on this machine's disk), and once the
real device's, where it has one, to see an O_DIRECT read counted."""

from __future__ import annotations

import errno
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest

from flatcake_ray.media.drive_activity import JOURNAL_SLACK, SECTOR, DriveActivity
from flatcake_ray.media.pool_prewrite import PoolPrewrite, unwritten_ranges
from flatcake_ray.metrics.definitions import BY_NAME
from flatcake_ray.metrics.view import collapse, format_view, status_view
from tests.test_pool_prewrite import folder  # noqa: F401  (fixture: skips without unwritten space)

FILE_BYTES = 1 << 20
STEP = 64 << 10


class FakeDrive:
    """A block device's stat file whose counters the test sets."""

    def __init__(self, where: Path) -> None:
        self.path = where / "stat"
        self.read_sectors = self.write_sectors = self.in_flight = 0
        self.publish()

    def publish(self) -> None:
        fields = [0] * 17
        fields[2], fields[6], fields[8] = self.read_sectors, self.write_sectors, self.in_flight
        self.path.write_text(" ".join(map(str, fields)) + "\n", encoding="ascii")

    def activity(self, fd: int) -> DriveActivity:
        return DriveActivity(str(self.path))


@pytest.fixture
def drive(tmp_path) -> FakeDrive:
    return FakeDrive(tmp_path)


@pytest.fixture
def pool_file(tmp_path):
    """One fallocated (never-written) pool file, open O_DIRECT; skipped where the file
    system reports no unwritten space (nothing to prewrite)."""
    path = tmp_path / "pool.fc"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, FILE_BYTES)
    os.close(fd)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    try:
        if unwritten_ranges(fd, FILE_BYTES) != [(0, FILE_BYTES)]:
            pytest.skip(f"{tmp_path}'s file system reports no unwritten extents")
        yield fd
    finally:
        os.close(fd)


def _until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_reads_writes_beyond_the_callers_and_commands_in_flight_are_others(drive):
    activity = drive.activity(0)
    assert not activity.others_since(0)
    drive.write_sectors += STEP // SECTOR + JOURNAL_SLACK // SECTOR  # its own step + journal
    drive.publish()
    assert not activity.others_since(STEP)
    drive.read_sectors += 8
    drive.publish()
    assert activity.others_since(0)
    assert not activity.others_since(0)  # nothing since that look
    drive.write_sectors += (STEP + 2 * JOURNAL_SLACK) // SECTOR
    drive.publish()
    assert activity.others_since(STEP)
    drive.in_flight = 1
    drive.publish()
    assert activity.others_since(0)


def _beside_busy_drive(drive: FakeDrive, pool_file: int, max_pause_s: float) -> PoolPrewrite:
    """A prewrite of ``pool_file`` started while a command is in flight on ``drive`` (a live
    restore's reads, never done while it looks)."""
    drive.in_flight = 1
    drive.publish()
    return PoolPrewrite(
        [pool_file], FILE_BYTES, STEP, activity=drive.activity, max_pause_s=max_pause_s
    )


def test_a_prewrite_waits_while_others_use_its_drive_then_finishes(drive, pool_file):
    prewrite = _beside_busy_drive(drive, pool_file, max_pause_s=30.0)
    try:
        time.sleep(0.3)
        assert prewrite.pending_bytes == FILE_BYTES  # not a step written beside them
        drive.in_flight = 0
        drive.publish()
        _until(lambda: prewrite.done)
        assert prewrite.pending_bytes == 0 and prewrite.paused_seconds >= 0.25
        assert unwritten_ranges(pool_file, FILE_BYTES) == []
    finally:
        prewrite.close()


def test_a_drive_that_is_never_idle_is_still_written_a_step_at_a_time(drive, pool_file):
    prewrite = _beside_busy_drive(drive, pool_file, max_pause_s=0.02)
    try:
        _until(lambda: prewrite.done)
        steps = FILE_BYTES // STEP
        assert prewrite.pending_bytes == 0 and prewrite.paused_seconds >= 0.9 * steps * 0.02
        assert unwritten_ranges(pool_file, FILE_BYTES) == []
    finally:
        prewrite.close()


def test_closing_a_waiting_prewrite_stops_it_at_once(drive, pool_file):
    prewrite = _beside_busy_drive(drive, pool_file, max_pause_s=30.0)
    time.sleep(0.05)
    started = time.monotonic()
    prewrite.close()
    assert time.monotonic() - started < 0.5 and prewrite.pending_bytes == FILE_BYTES


def test_the_real_drive_counts_an_o_direct_read(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 1 << 20, np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        activity = DriveActivity.of(fd)
    finally:
        os.close(fd)
    if activity is None:
        pytest.skip(f"{tmp_path} is on a device with no /sys/dev/block counters")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    try:
        buffer = np.frombuffer(mmap.mmap(-1, 1 << 20), np.uint8)  # page-aligned
        activity.others_since(0)
        os.preadv(fd, [memoryview(buffer)], 0)
        assert activity.others_since(0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("paced", [True, False])
def test_a_store_paces_its_prewrite_unless_configured_not_to(
    folder,  # noqa: F811
    make_store,
    monkeypatch,
    paced,
):
    """``ssd_prewrite_paced`` (on by default; the benches turn it off: nothing live to yield
    to, and a neighbour's I/O must not stretch their wait) reaches the store's pool."""
    busy = _always_busy_drive(monkeypatch)
    store = make_store(ssd_prewrite=True, ssd_prewrite_paced=paced)
    _until(lambda: not store.stats()["ssd_prewrite_pending"], timeout_s=30.0)
    waited = store.stats()["ssd_prewrite_waited_s"]
    assert (waited > 0.5) if paced else (waited == 0.0 and busy.looks == 0)


def test_status_says_how_long_a_prewrite_still_to_go_waited_for_its_drive(
    folder,  # noqa: F811
    make_store,
    monkeypatch,
    failpoints,
):
    """An operator who sees a prewrite that is slow to finish sees why: it has waited for
    live I/O (here a drive always busy; the prewrite stopped at its second step, so bytes
    stay to go)."""
    _always_busy_drive(monkeypatch)
    failpoints.arm("pool.prewrite", raises=OSError(errno.EIO, "injected"), times=1, skip=1)
    store = make_store(ssd_prewrite=True)
    _until(lambda: store.stats()["ssd_prewrite_error"], timeout_s=30.0)
    stats = store.stats()
    assert stats["ssd_prewrite_pending"] > 0 and stats["ssd_prewrite_waited_s"] >= 1.5
    series = BY_NAME["flatcake_ssd_prewrite_waited_seconds"].exported
    samples = store.metrics.samples()
    gauge = [sample.value for sample in collapse(samples) if sample.name == series]
    assert gauge == [stats["ssd_prewrite_waited_s"]]
    shown = format_view(status_view(samples))
    assert f"waited {stats['ssd_prewrite_waited_s']:.0f} s for an idle drive" in shown


class _Busy:
    """A drive someone always uses; counts the looks."""

    looks = 0

    def others_since(self, own_bytes: int) -> bool:
        type(self).looks += 1
        return True


def _always_busy_drive(monkeypatch) -> type[_Busy]:
    _Busy.looks = 0
    monkeypatch.setattr(DriveActivity, "of", classmethod(lambda cls, fd: _Busy()))
    return _Busy
