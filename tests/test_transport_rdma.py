"""One-sided RDMA READ over pyverbs: runs where an RDMA device exists, skips with the reason
elsewhere. The probe, the pure helpers, and both sides over a stand-in NIC that checks keys
and bounds as a real one does (``tests/rdma_fake.py``: per-tenant chunk regions, a renewed
chunk's key) run everywhere."""

from __future__ import annotations

import dataclasses
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatcake_ray.errors import (
    ForeignMemoryError,
    ReadRangeError,
    TransferError,
    TransportClosedError,
    TransportUnavailableError,
)
from flatcake_ray.transports.base import REMOTE_DRAM_RDMA, ReadBatch
from flatcake_ray.transports.rdma_export import RdmaArenaExporter
from flatcake_ray.transports.rdma_verbs import (
    RdmaEndpoint,
    RdmaRegion,
    RdmaVerbsTransport,
    placed,
    split_ranges,
)
from tests.rdma_fake import Fabric, FakePort

REASON = RdmaVerbsTransport.probe()


def test_probe_explains_why_rdma_is_unusable_here():
    if REASON is None:
        pytest.skip("an RDMA device is present: the no-device path cannot be checked here")
    print(f"RDMA probe: {REASON}")
    assert isinstance(REASON, str) and REASON.strip()
    with pytest.raises(TransportUnavailableError, match=re.escape(REASON.split(" (")[0])):
        RdmaVerbsTransport()


def test_importing_the_module_does_not_import_pyverbs():
    code = (
        "import sys, flatcake_ray.transports.rdma_verbs as m\n"
        "assert 'pyverbs' not in sys.modules\n"
        "m.split_ranges(m.ReadBatch([0], [10], [0]), 4)\n"
        "assert 'pyverbs' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_endpoint_survives_pickling_for_a_ray_call():
    regions = (RdmaRegion(0, 64, 9), RdmaRegion(128, 64, 11))
    endpoint = RdmaEndpoint(
        7, 123, 1, "fe80:0000:0000:0000:0000:0000:0000:0001", 5, 4096, 256, regions
    )
    assert pickle.loads(pickle.dumps(endpoint)) == endpoint
    assert RdmaEndpoint(1, 2, 3, "g", 4).regions == ()  # a reader exports nothing


def test_split_ranges_keeps_every_byte_in_order():
    batch = ReadBatch([0, 100, 1000], [10, 3, 25], [500, 0, 50])
    pieces = split_ranges(batch, limit=8)
    assert pieces.lengths.tolist() == [8, 2, 3, 8, 8, 8, 1]
    assert pieces.src_offsets.tolist() == [0, 8, 100, 1000, 1008, 1016, 1024]
    assert pieces.dst_offsets.tolist() == [500, 508, 0, 50, 58, 66, 74]
    assert split_ranges(batch, limit=25) is batch


def test_pieces_are_cut_at_region_borders_and_keyed_by_their_region():
    regions = (RdmaRegion(0, 100, 7), RdmaRegion(100, 100, 8), RdmaRegion(300, 100, 9))
    pieces, keys = placed(ReadBatch([90, 310], [20, 50], [0, 20]), regions, limit=32)
    assert pieces.src_offsets.tolist() == [90, 100, 310, 342]
    assert pieces.lengths.tolist() == [10, 10, 32, 18]
    assert pieces.dst_offsets.tolist() == [0, 10, 20, 52]
    assert keys.tolist() == [7, 8, 9, 9]
    for outside in ([190], [200], [250], [399]):  # into a gap; in it; past the last region
        assert placed(ReadBatch(outside, [20], [0]), regions, limit=32) is None


@settings(max_examples=60, deadline=None)
@given(
    held=st.sets(st.integers(0, 7), min_size=1),
    ranges=st.lists(st.tuples(st.integers(0, 8 * 64 - 1), st.integers(1, 200)), max_size=8),
)
def test_placed_pieces_cover_each_byte_once_inside_a_region_given(held, ranges):
    regions = tuple(RdmaRegion(c * 64, 64, 100 + c) for c in sorted(held))
    src = [s for s, _ in ranges]
    lengths = [min(n, 8 * 64 - s) for s, n in ranges]
    dst = np.cumsum([0, *lengths])[:-1].tolist()
    found = placed(ReadBatch(src, lengths, dst), regions, limit=48)
    wanted = {b for s, n in zip(src, lengths, strict=True) for b in range(s, s + n)}
    if not wanted <= {b for c in held for b in range(c * 64, c * 64 + 64)}:
        assert found is None  # a byte of a chunk not given: nothing posted
        return
    assert found is not None
    pieces, keys = found
    covered: list[int] = []
    for s, n, key in zip(pieces.src_offsets, pieces.lengths, keys, strict=True):
        assert key == 100 + s // 64 and (s + n - 1) // 64 == s // 64 and n <= 48
        covered += range(int(s), int(s + n))
    assert sorted(covered) == sorted(
        b for s, n in zip(src, lengths, strict=True) for b in range(s, s + n)
    )


CHUNK = 64 << 10


@pytest.fixture
def fake_export():
    """An arena of four chunks exported over the stand-in NIC, and a reader maker."""
    fabric = Fabric()
    arena = np.frombuffer(np.random.default_rng(3).bytes(4 * CHUNK), dtype=np.uint8).copy()
    exporter = RdmaArenaExporter(arena, chunk_bytes=CHUNK, port=FakePort(fabric))
    readers: list[RdmaVerbsTransport] = []

    def reader(given: list[int], refresh=None) -> RdmaVerbsTransport:
        readers.append(
            RdmaVerbsTransport.connected(
                lambda mine: exporter.accept(mine, given),
                port=FakePort(fabric),
                timeout_s=5,
                refresh=refresh,
            )
        )
        return readers[-1]

    yield fabric, arena, exporter, reader
    for made in readers:
        made.close()
    exporter.close()


def test_a_reader_gets_the_keys_of_its_tenants_chunks_only(fake_export):
    fabric, arena, exporter, reader = fake_export
    tenant = reader([0, 2 * CHUNK])
    out = np.zeros(2 * CHUNK, np.uint8)
    tenant.read(ReadBatch([100, 2 * CHUNK + 7], [5000, CHUNK - 7], [0, 5000]), out)
    assert np.array_equal(out[:5000], arena[100:5100])
    assert np.array_equal(out[5000 : 5000 + CHUNK - 7], arena[2 * CHUNK + 7 : 3 * CHUNK])
    with pytest.raises(ForeignMemoryError):  # chunk 1: not its tenant's, nothing posted
        tenant.read(ReadBatch([CHUNK + 10], [64], [0]), out)
    assert all(
        address < arena.ctypes.data + CHUNK or address >= arena.ctypes.data + 2 * CHUNK
        for address, _ in fabric.reads
    )
    # Past the transport's own check (a patched client that claims the whole arena under
    # the key of its chunk 0): the owner's NIC refuses the range, nothing is copied.
    (first, _) = exporter.regions([0, 2 * CHUNK])
    tenant._peer = dataclasses.replace(
        tenant._peer, regions=(RdmaRegion(0, 4 * CHUNK, first.rkey),)
    )
    out[:] = 0
    with pytest.raises(TransferError, match="status 10"):
        tenant.read(ReadBatch([CHUNK + 10], [64], [0]), out)
    assert tenant.broken and not out.any()


def test_a_reader_learns_a_chunk_its_tenant_took_since(fake_export):
    _, arena, exporter, reader = fake_export
    held = [0]
    tenant = reader(list(held), refresh=lambda: exporter.regions(held))
    held.append(CHUNK)  # its tenant grew into chunk 1
    out = np.zeros(256, np.uint8)
    tenant.read(ReadBatch([CHUNK - 128], [256], [0]), out)  # across the border, two keys
    assert np.array_equal(out, arena[CHUNK - 128 : CHUNK + 128])


def test_a_renewed_chunk_takes_its_old_key_with_it(fake_export):
    _, arena, exporter, reader = fake_export
    former = reader([CHUNK])
    out = np.zeros(64, np.uint8)
    former.read(ReadBatch([CHUNK], [64], [0]), out)
    exporter.renew(CHUNK)  # the chunk changed tenants: registered again
    with pytest.raises(TransferError, match="status 10"):  # the old key is dead
        former.read(ReadBatch([CHUNK], [64], [0]), out)
    assert former.broken
    other = reader([0])
    other.read(ReadBatch([0], [64], [0]), out)  # another chunk's readers: untouched
    heir = reader([CHUNK])  # the next tenant's reader, with the new key
    heir.read(ReadBatch([CHUNK + 64], [64], [0]), out)
    assert np.array_equal(out, arena[CHUNK + 64 : CHUNK + 128])


# --------------------------------------------------------------------------- with a device


@pytest.fixture
def loopback_pair():
    """An exporter and a reader on the same device port, connected to each other."""
    if REASON is not None:
        pytest.skip(REASON)
    arena = np.frombuffer(np.random.default_rng(11).bytes(8 << 20), dtype=np.uint8)
    exporter = RdmaArenaExporter(arena, chunk_bytes=2 << 20)
    transport = RdmaVerbsTransport.connected(
        lambda mine: exporter.accept(mine, range(0, arena.size, 2 << 20)), timeout_s=10
    )
    yield arena, transport
    transport.close()
    exporter.close()


def test_rdma_reads_scattered_ranges(loopback_pair):
    arena, transport = loopback_pair
    src = [0, 4096, arena.size - 1, 12345]
    batch = ReadBatch(src, [4096, 1 << 20, 1, 777], [0, 8192, 5000, 6000])
    dst = np.zeros(8192 + (1 << 20), np.uint8)
    stats = transport.read(batch, dst)
    for s, n, d in zip(batch.src_offsets, batch.lengths, batch.dst_offsets, strict=True):
        np.testing.assert_array_equal(dst[d : d + n], arena[s : s + n])
    assert (stats.bytes, stats.path) == (batch.total_bytes, REMOTE_DRAM_RDMA)
    print(f"RDMA READ: {stats.gb_per_s:.2f} GB/s over {stats.commands} work requests")


def test_rdma_rejects_out_of_range_and_closes(loopback_pair):
    arena, transport = loopback_pair
    dst = np.zeros(16, np.uint8)
    with pytest.raises(ReadRangeError):
        transport.read(ReadBatch([arena.size - 8], [9], [0]), dst)
    transport.close()
    with pytest.raises(TransportClosedError):
        transport.read(ReadBatch([0], [16], [0]), dst)
