"""The data path's host copies and put checksums split over threads: the same bytes and the
same sums as one thread's, whatever the split (``cuda_ext/host_copy.py``,
``node/checksums.py``), and the SSD reads cut for queue depth (``transports/local_ssd.py``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatcake_ray.core.integrity import block_checksums, layer_checksums
from flatcake_ray.core.layout import SegmentLayout
from flatcake_ray.cuda_ext import host_copy, host_hash
from flatcake_ray.node import checksums
from flatcake_ray.transports.base import ReadBatch
from flatcake_ray.transports.local_ssd import PIECE_BYTES, depth_pieces


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"{n}-threads")
def threads(request, monkeypatch) -> int:
    monkeypatch.setattr(host_copy, "idle_threads", lambda: request.param)
    monkeypatch.setattr(checksums, "idle_threads", lambda: request.param)
    monkeypatch.setattr(host_copy, "PIECE_BYTES", 1 << 16)  # many pieces from small arrays
    monkeypatch.setattr(host_copy, "SPLIT_BYTES", 1 << 16)
    monkeypatch.setattr(host_copy, "ROW_BYTES", 1 << 14)  # long rows cut, claimed in turns
    monkeypatch.setattr(checksums, "SPLIT_BYTES", 1 << 16)
    return request.param


def test_copy_many_moves_every_byte_of_every_pair(threads: int) -> None:
    rng = np.random.default_rng(threads)
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for size in (1, 70_000, 300_001)]
    targets = [np.zeros_like(source) for source in sources]
    host_copy.copy_many(list(zip(targets, sources, strict=True)))
    for target, source in zip(targets, sources, strict=True):
        assert np.array_equal(target, source)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    src_at=st.integers(0, 63),
    dst_at=st.integers(0, 63),
    nbytes=st.one_of(st.integers(0, 600), st.integers(60_000, 200_000)),
)
def test_a_copy_moves_the_same_bytes_wherever_its_arrays_start(
    native_pass: bool, threads: int, src_at: int, dst_at: int, nbytes: int
) -> None:
    """The native copy takes aligned stores whatever the arrays' alignment (glibc's memcpy
    ran at half speed or less for some): every byte lands, none outside the target."""
    rng = np.random.default_rng(nbytes)
    source = rng.integers(0, 256, nbytes + 64, dtype=np.uint8)
    target = np.zeros(nbytes + 128, dtype=np.uint8)
    host_copy.copy_into(target[dst_at : dst_at + nbytes], source[src_at : src_at + nbytes])
    assert np.array_equal(target[dst_at : dst_at + nbytes], source[src_at : src_at + nbytes])
    assert not target[:dst_at].any() and not target[dst_at + nbytes :].any()


def test_copy_into_a_strided_destination_copies_row_by_row(threads: int) -> None:
    source = np.arange(40 * 8192, dtype=np.uint32).reshape(40, 8192)
    pool = np.zeros((80, 8192), dtype=np.uint32)
    host_copy.copy_into(pool[::2], source)  # every other row: not contiguous
    assert np.array_equal(pool[::2], source) and not pool[1::2].any()


def test_run_split_raises_the_first_error_after_every_task_ended() -> None:
    ran: list[int] = []

    def fail() -> None:
        ran.append(1)
        raise ValueError("task failed")

    with pytest.raises(ValueError, match="task failed"):
        host_copy.run_split([lambda: ran.append(0), fail, lambda: ran.append(2)])
    assert sorted(ran) == [0, 1, 2]


@pytest.mark.parametrize(
    ("idle_seconds", "own_seconds", "threads"),
    [(0.0, 4.0, 2), (0.0, 0.0, 1), (2.0, 0.0, 1), (4.0, 0.0, 2), (1.0, 2.0, 2)],
    ids=["busy-copying-itself", "others-take-both", "one-idle", "both-idle", "half-and-own"],
)
def test_copies_split_over_the_cores_other_processes_leave(
    monkeypatch, idle_seconds: float, own_seconds: float, threads: int
) -> None:
    """Over 2 s on 2 cores: the machine's idle core seconds plus this process's own CPU
    seconds are the cores left to it (its own copies never count as a busy machine)."""
    samples = iter([(10.0, 100.0, 5.0), (12.0, 100.0 + idle_seconds, 5.0 + own_seconds)])
    monkeypatch.setattr(host_copy, "cpu_sample", lambda: next(samples))
    monkeypatch.setattr(host_copy, "copy_threads", lambda: 2)
    monkeypatch.setattr(host_copy, "_last_cpu", None)
    for _ in range(2):
        monkeypatch.setattr(host_copy, "_idle", (float("-inf"), 1))
        found = host_copy.idle_threads()
    assert found == threads


def test_a_process_that_waited_goes_by_the_load_average(monkeypatch) -> None:
    """Readings further apart than a few seconds would count a quiet spell as idle cores now
    (many processes that waited, then copy at once): the load average decides instead."""
    samples = iter([(10.0, 100.0, 5.0), (40.0, 160.0, 5.0)])  # both cores idle for 30 s
    monkeypatch.setattr(host_copy, "cpu_sample", lambda: next(samples))
    monkeypatch.setattr(host_copy, "copy_threads", lambda: 2)
    monkeypatch.setattr(host_copy.os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    monkeypatch.setattr(host_copy, "_last_cpu", None)
    for _ in range(2):
        monkeypatch.setattr(host_copy, "_idle", (float("-inf"), 1))
        found = host_copy.idle_threads()
    assert found == 1


@pytest.mark.parametrize("pages", [1, 5, 37])
def test_put_checksums_equal_the_readers_whatever_the_split(threads: int, pages: int) -> None:
    layout = SegmentLayout(pages=pages, layers=1, page_bytes=4096, check_pages=4)
    extent = np.random.default_rng(pages).integers(0, 256, layout.layer_bytes, dtype=np.uint8)
    assert np.array_equal(
        checksums.parallel_layer_checksums(extent, layout), layer_checksums(extent, layout)
    )


@pytest.mark.parametrize("nbytes", [1, 4096 * 5, 4096 * 37 + 123])
def test_a_fused_copy_moves_the_bytes_and_hashes_each_block_like_the_reader(
    threads: int, nbytes: int, monkeypatch
) -> None:
    if not host_hash.fused():
        pytest.skip(
            "no fused copy: cuda_ext/_copyhash.c not built "
            "(FLATCAKE_NATIVE=0, no compiler) or no libxxhash"
        )
    monkeypatch.setattr(host_copy, "SPLIT_BYTES", 1 << 12)
    source = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    target = np.zeros_like(source)
    sums = host_hash.copy_hashing_source(target, source, 4 * 4096)
    assert np.array_equal(target, source)
    assert sums is not None
    assert np.array_equal(sums, block_checksums(source, 4 * 4096))


def test_a_batch_of_long_copies_and_hashed_blocks_keeps_each_rows_sum_in_place(
    threads: int,
) -> None:
    """Long copy-only rows are cut for the threads to claim in turns; the sums still come
    back one per row of the batch as given, 0 where a row hashes nothing."""
    if not host_hash.fused():
        pytest.skip("no fused copy: cuda_ext/_copyhash.c not built or no libxxhash")
    rng = np.random.default_rng(threads)
    source = rng.integers(0, 256, 600_000, dtype=np.uint8)
    target = np.zeros_like(source)
    cuts = [0, 150_000, 151_000, 400_000, 401_000, 600_000]  # long, short, long, short, long
    ops = np.zeros((len(cuts) - 1, 4), dtype=np.int64)
    for row, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        ops[row, host_copy.DST] = target.ctypes.data + lo
        ops[row, host_copy.SRC] = source.ctypes.data + lo
        ops[row, host_copy.LENGTH] = hi - lo
        if row % 2:  # the short rows are hashed where they land
            ops[row, host_copy.HASH_AT] = target.ctypes.data + lo
    sums = host_hash.copy_and_hash(ops)
    assert sums is not None and np.array_equal(target, source)
    for row, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        want = int(block_checksums(source[lo:hi], hi - lo)[0]) if row % 2 else 0
        assert int(sums[row]) == want


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    src_at=st.integers(0, 63),
    dst_at=st.integers(0, 63),
    nbytes=st.one_of(st.integers(1, 2_000), st.integers(60_000, 140_000)),
    hash_the_target=st.booleans(),
)
def test_a_row_that_copies_and_hashes_gets_libxxhash_s_sum_wherever_its_bytes_sit(
    native_pass: bool,
    threads: int,
    src_at: int,
    dst_at: int,
    nbytes: int,
    hash_the_target: bool,
) -> None:
    """The native pass hashes a row's bytes inside its copy loop (over 240 bytes: XXH3's long
    form, non-temporal stores from 64 KiB), whether the row hashes where it reads (a writer's
    own sums) or where it writes (a reader's check): the sum is the reader's xxh3-64, and
    every byte lands, none outside the target."""
    if not host_hash.fused():
        pytest.skip("no fused copy: cuda_ext/_copyhash.c not built or no libxxhash")
    source = np.random.default_rng(nbytes).integers(0, 256, nbytes + 64, dtype=np.uint8)
    target = np.zeros(nbytes + 128, dtype=np.uint8)
    ops = np.zeros((1, 4), dtype=np.int64)
    ops[0, host_copy.DST] = target.ctypes.data + dst_at
    ops[0, host_copy.SRC] = source.ctypes.data + src_at
    ops[0, host_copy.LENGTH] = nbytes
    ops[0, host_copy.HASH_AT] = ops[0, host_copy.DST if hash_the_target else host_copy.SRC]
    sums = host_hash.copy_and_hash(ops)
    written = source[src_at : src_at + nbytes]
    assert sums is not None and np.array_equal(target[dst_at : dst_at + nbytes], written)
    assert int(sums[0]) == int(block_checksums(written, nbytes)[0])
    assert not target[:dst_at].any() and not target[dst_at + nbytes :].any()


def test_ssd_reads_are_cut_into_pieces_that_cover_each_range_once() -> None:
    long, short = 3 * PIECE_BYTES + 4096, 8192
    batch = ReadBatch([0, 10 * PIECE_BYTES], [long, short], [1 << 30, 0])
    commands = depth_pieces(batch)
    assert commands[-1] == (10 * PIECE_BYTES, short, 0)  # a short range stays whole
    pieces = commands[:-1]
    assert [n for _, n, _ in pieces] == [PIECE_BYTES] * 3 + [4096]
    assert [src for src, _, _ in pieces] == [i * PIECE_BYTES for i in range(4)]
    assert all(dst - src == 1 << 30 for src, _, dst in pieces)  # each lands where its bytes go


@pytest.mark.parametrize(
    ("page_bytes", "pieces_a_page", "pages_a_block"),
    [(32768, 2, 2), (8192, 2, 8), (4096, 1, 16), (320, 5, 3), (448, 7, 1)],
)
def test_a_block_copied_into_pieces_lands_in_them_in_order_with_libxxhash_s_sum(
    native_pass: bool, threads: int, page_bytes: int, pieces_a_page: int, pages_a_block: int
) -> None:
    """A checked restore into pages split in memory (vLLM's K and V planes) copies each block
    straight into its pieces, wherever they lie, and hashes it in the same pass: each block's
    bytes land piece after piece, its sum is the reader's xxh3-64, nothing else is written.
    Only the AVX2 pass has it (the plain one says so and the restore takes its other path);
    rows it cannot take are a ValueError, with nothing copied."""
    if not host_hash.fused():
        pytest.skip("no fused copy: cuda_ext/_copyhash.c not built or no libxxhash")
    if native_pass and not host_hash.pieces_pass():
        pytest.skip("this CPU has no AVX2: the restore copies into a scratch buffer instead")
    blocks, piece = 5, page_bytes // pieces_a_page
    block_bytes = page_bytes * pages_a_block
    rng = np.random.default_rng(page_bytes + pieces_a_page)
    source = rng.integers(0, 256, blocks * block_bytes, dtype=np.uint8)
    target = np.zeros(2 * source.nbytes, dtype=np.uint8)
    count = blocks * pages_a_block * pieces_a_page
    slots = rng.permutation(2 * count)[:count]  # every piece somewhere, none overlapping
    pieces = target.ctypes.data + slots * piece
    rows = np.array(
        [
            [source.ctypes.data + b * block_bytes, block_bytes, b * block_bytes // piece, piece]
            for b in range(blocks)
        ],
        dtype=np.int64,
    )
    if not native_pass:
        with pytest.raises(ValueError, match="AVX2"):
            host_hash.copy_and_hash_pieces(rows, pieces)
        assert not target.any()
        return
    sums = host_hash.copy_and_hash_pieces(rows, pieces)
    landed = np.concatenate([target[s * piece : (s + 1) * piece] for s in slots])
    assert np.array_equal(landed, source)
    assert np.array_equal(sums, block_checksums(source, block_bytes))
    untouched = np.setdiff1d(np.arange(2 * count), slots)
    assert not any(target[s * piece : (s + 1) * piece].any() for s in untouched)
    target[:] = 0
    for bad in ([0, 200, 0, 64], [0, 1024, 0, 96], [0, 1024, count - 1, 512]):
        row = np.array([bad], dtype=np.int64)
        row[0, 0] += source.ctypes.data
        with pytest.raises(ValueError, match="row"):
            host_hash.copy_and_hash_pieces(row, pieces)
    assert not target.any()
