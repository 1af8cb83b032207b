"""One-sided RDMA READ over pyverbs: runs where an RDMA device exists, skips with the reason
elsewhere. The probe and the pure helpers are checked everywhere."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

from flatcake_ray.errors import ReadRangeError, TransportClosedError, TransportUnavailableError
from flatcake_ray.transports.base import REMOTE_DRAM_RDMA, ReadBatch
from flatcake_ray.transports.rdma_verbs import (
    RdmaArenaExporter,
    RdmaEndpoint,
    RdmaVerbsTransport,
    split_ranges,
)

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
    endpoint = RdmaEndpoint(7, 123, 1, "fe80:0000:0000:0000:0000:0000:0000:0001", 5, 4096, 64, 9)
    assert pickle.loads(pickle.dumps(endpoint)) == endpoint
    assert RdmaEndpoint(1, 2, 3, "g", 4).rkey == 0  # a reader exports nothing


def test_split_ranges_keeps_every_byte_in_order():
    batch = ReadBatch([0, 100, 1000], [10, 3, 25], [500, 0, 50])
    pieces = split_ranges(batch, limit=8)
    assert pieces.lengths.tolist() == [8, 2, 3, 8, 8, 8, 1]
    assert pieces.src_offsets.tolist() == [0, 8, 100, 1000, 1008, 1016, 1024]
    assert pieces.dst_offsets.tolist() == [500, 508, 0, 50, 58, 66, 74]
    assert split_ranges(batch, limit=25) is batch


# --------------------------------------------------------------------------- with a device


@pytest.fixture
def loopback_pair():
    """An exporter and a reader on the same device port, connected to each other."""
    if REASON is not None:
        pytest.skip(REASON)
    arena = np.frombuffer(np.random.default_rng(11).bytes(8 << 20), dtype=np.uint8)
    exporter = RdmaArenaExporter(arena)
    transport = RdmaVerbsTransport.connected(exporter.accept, timeout_s=10)
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
