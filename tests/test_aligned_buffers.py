"""I/O buffers of O_DIRECT reads and writes: aligned, private, and asking for huge pages.

A block device takes a command as physically contiguous segments; in 4 KiB pages a 4 MiB
read is split into requests of about 1 MiB, so the restore's slots, the put's staging and the
ship buffer ask the kernel for transparent huge pages (``media/buffers.py``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from flatcake_ray.media.buffers import HUGE_PAGE, AlignedBuffer
from flatcake_ray.media.pool import SsdPool


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture
def buffers():
    """``buffers(nbytes)``: a fresh AlignedBuffer, closed at the test's end."""
    made: list[AlignedBuffer] = []

    def make(nbytes: int) -> AlignedBuffer:
        made.append(AlignedBuffer(nbytes))
        return made[-1]

    yield make
    for buffer in made:
        buffer.close()


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
    reason="this kernel has no transparent huge pages: buffers stay in 4 KiB pages",
)
def test_a_buffer_of_a_huge_page_or_more_starts_on_one_and_asks_for_huge_pages(buffers):
    buffer = buffers(3 * HUGE_PAGE + 4096)
    assert buffer.array.nbytes == buffer.nbytes == 3 * HUGE_PAGE + 4096
    assert buffer.array.ctypes.data % HUGE_PAGE == 0
    assert "hg" in _vm_flags(buffer.array.ctypes.data)  # MADV_HUGEPAGE on its mapping


def test_a_small_buffer_is_page_aligned_rounded_up_and_left_alone(buffers):
    buffer = buffers(5000)
    assert buffer.nbytes == 8192 and buffer.array.ctypes.data % 4096 == 0
    assert "hg" not in _vm_flags(buffer.array.ctypes.data)


def test_buffers_are_private_zeroed_memory_a_pool_writes_from_and_reads_into(buffers, tmp_path):
    data = np.random.default_rng(3).integers(0, 256, 2 * HUGE_PAGE, dtype=np.uint8)
    written, read = buffers(data.nbytes), buffers(data.nbytes)
    assert not read.array.any()
    assert "sh" not in _vm_flags(read.array.ctypes.data)  # not shared memory (no THP there)
    written.array[:] = data
    pool = SsdPool((str(tmp_path),), 1, 4 * HUGE_PAGE)
    try:
        pool.write(HUGE_PAGE, written.array)
        assert pool.read_into(0, HUGE_PAGE, read.array) == data.nbytes
    finally:
        pool.close()
    assert np.array_equal(read.array, data)
