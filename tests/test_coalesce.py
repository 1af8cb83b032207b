import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flatcake_ray.core.coalesce import coalesce


def test_adjacent_descriptors_merge_out_of_order():
    reads = coalesce([0, 0, 0], [8192, 0, 4096], [4096, 4096, 4096], gap_bytes=0)
    assert reads.count == 1
    assert (reads.offsets[0], reads.lengths[0]) == (0, 12288)
    assert list(reads.descriptor_skip) == [8192, 0, 4096]


def test_small_gap_is_bridged_large_gap_is_not():
    bridged = coalesce([0, 0], [0, 4096 + 60_000], [4096, 4096], gap_bytes=64 << 10)
    split = coalesce([0, 0], [0, 4096 + 70_000], [4096, 4096], gap_bytes=64 << 10)
    assert bridged.count == 1 and bridged.bytes == 4096 + 60_000 + 4096
    assert split.count == 2 and split.bytes == 8192


def test_files_never_merge():
    reads = coalesce([0, 1], [0, 4096], [4096, 4096])
    assert reads.count == 2
    assert sorted(reads.files.tolist()) == [0, 1]


def test_alignment_widens_reads():
    reads = coalesce([0], [5000], [100], align=4096)
    assert (reads.offsets[0], reads.lengths[0], reads.descriptor_skip[0]) == (4096, 4096, 904)


def test_max_read_bytes_splits_long_runs():
    reads = coalesce([0] * 8, np.arange(8) * 4096, [4096] * 8, max_read_bytes=3 * 4096)
    assert reads.count == 3
    assert reads.lengths.max() <= 3 * 4096


def test_t_turn_session_costs_at_most_layers_times_turns_reads():
    layers, turns, pages, page = 5, 4, 7, 3000
    files, offsets, lengths = [], [], []
    base = 0
    for _ in range(turns):  # each turn a layer-major segment, 4 KiB aligned layers
        stride = -(-pages * page // 4096) * 4096
        for layer in range(layers):
            for p in range(pages):
                files.append(0)
                offsets.append(base + layer * stride + p * page)
                lengths.append(page)
        base += layers * stride + (1 << 20)  # turns are far apart (other scopes between)
    reads = coalesce(files, offsets, lengths, gap_bytes=0, align=4096)
    assert reads.count <= layers * turns
    assert len(offsets) == layers * turns * pages


def test_bad_descriptors_are_rejected():
    with pytest.raises(ValueError):
        coalesce([0], [0], [0])
    with pytest.raises(ValueError):
        coalesce([0, 0], [0], [1])


descriptor = st.tuples(st.integers(0, 3), st.integers(0, 1 << 22), st.integers(1, 1 << 16))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(descriptor, min_size=1, max_size=60),
    st.sampled_from([0, 4096, 65536]),
    st.sampled_from([1, 512, 4096]),
    st.sampled_from([None, 1 << 17, 1 << 20]),
)
@example([(0, 20481, 65536), (0, 86017, 65536)], 0, 512, 1 << 17)  # they share a 512 B block
def test_every_descriptor_is_covered_exactly(descs, gap, align, cap):
    files, offsets, lengths = map(np.array, zip(*descs, strict=True))
    reads = coalesce(files, offsets, lengths, gap_bytes=gap, align=align, max_read_bytes=cap)
    r = reads.descriptor_read
    assert (reads.files[r] == files).all()
    assert (reads.offsets[r] + reads.descriptor_skip == offsets).all()
    assert (reads.descriptor_skip + lengths <= reads.lengths[r]).all()
    assert (reads.offsets % align == 0).all() and (reads.lengths % align == 0).all()
    assert reads.count <= len(descs)
    # Reads of one file overlap only where one read holding both would pass the cap: a cap
    # split descriptors that need the same aligned bytes (adjacent ones sharing a block), and
    # each read holds whole descriptors.
    order = np.lexsort((reads.offsets, reads.files))
    f, o, n = reads.files[order], reads.offsets[order], reads.lengths[order]
    overlapping = (f[1:] == f[:-1]) & (o[1:] < (o + n)[:-1])
    joined = np.maximum((o + n)[1:], (o + n)[:-1]) - o[:-1]
    assert not overlapping.any() or (cap is not None and (joined[overlapping] > cap).all())
