"""The transport interface without a peer: read batches validate and freeze, the registration
cache reuses and evicts, and importing the transports loads neither NIXL nor pyverbs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from flatcake_ray.errors import ReadRangeError, ShapeError
from flatcake_ray.transports.base import ReadBatch, RegistrationCache

# --------------------------------------------------------------------------- the interface


def test_read_batch_validates_and_freezes():
    src = np.array([0, 10])
    batch = ReadBatch(src, [5, 0], [0, 5])
    src[0] = 99
    assert batch.src_offsets.tolist() == [0, 10]  # a private copy
    assert batch.src_offsets.dtype == np.int64 and not batch.src_offsets.flags.writeable
    assert len(batch) == 2 and batch.total_bytes == 5
    assert len(batch.nonempty()) == 1
    for bad in (([0], [-1], [0]), ([0, 1], [1], [0]), ([0.5], [1], [0]), ([[0]], [[1]], [[0]])):
        with pytest.raises(ReadRangeError):
            ReadBatch(*bad)
    with pytest.raises(ValueError):  # the typed error is also a ValueError
        ReadBatch([1 << 48], [1], [0])
    assert ReadBatch.packed([100, 7], [3, 4], dst_start=2).dst_offsets.tolist() == [2, 5]


def test_read_batch_checks_source_and_destination():
    batch = ReadBatch([0, 90], [10, 10], [0, 10])
    batch.check_source(100, "src")
    with pytest.raises(ReadRangeError, match="past the 99 bytes"):
        batch.check_source(99, "src")
    batch.check_destination(np.zeros(20, np.uint8))
    with pytest.raises(ReadRangeError):
        batch.check_destination(np.zeros(19, np.uint8))
    with pytest.raises(ReadRangeError, match="overlap"):
        ReadBatch([0, 0], [10, 10], [0, 9]).check_destination(np.zeros(20, np.uint8))
    for bad_dst in (
        np.zeros(20, np.int8),
        np.zeros((2, 10), np.uint8),
        np.zeros(40, np.uint8)[::2],
    ):
        with pytest.raises(ShapeError):
            batch.check_destination(bad_dst)
    frozen = np.zeros(20, np.uint8)
    frozen.setflags(write=False)
    with pytest.raises(ShapeError):
        batch.check_destination(frozen)


def test_registration_cache_reuses_covering_entries_and_evicts_idle_ones():
    log: list[str] = []
    cache = RegistrationCache(
        lambda buf: log.append(f"reg {buf.nbytes}") or buf.nbytes,
        lambda handle: log.append(f"rel {handle}"),
        capacity=1,
    )
    staging = np.zeros(100, np.uint8)
    with cache.use(staging) as handle:
        assert handle == 100
    with cache.use(staging[10:50]) as handle:  # a slice rides on the whole buffer's entry
        assert handle == 100
    assert log == ["reg 100"]
    other = np.zeros(30, np.uint8)
    with cache.use(other), cache.use(staging):  # staging was idle: evicted, then back
        assert len(cache) == 2  # over capacity, but an entry in use is never evicted
    with cache.use(np.zeros(7, np.uint8)):
        assert len(cache) == 1
    cache.clear()
    assert len(cache) == 0
    assert log == ["reg 100", "reg 30", "rel 100", "reg 100", "reg 7", "rel 30", "rel 100", "rel 7"]


def test_importing_transports_loads_neither_nixl_nor_pyverbs():
    code = (
        "import sys, flatcake_ray.transports, flatcake_ray.transports.base, "
        "flatcake_ray.transports.routing, flatcake_ray.transports.nixl_dram, "
        "flatcake_ray.transports.rdma_verbs\n"
        "loaded = [m for m in ('nixl', 'pyverbs', 'torch') if m in sys.modules]\n"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
