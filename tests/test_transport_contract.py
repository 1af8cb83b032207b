"""One contract, every transport: the same assertions for each data path usable here.

The source is a real storage node (a Ray actor, its own process) holding one DRAM and one SSD
segment of known bytes. Each transport is built the way a client builds it
(``NodeLink.transport``) and reads ranges of those segments; paths this machine cannot run
(RDMA, NVMe-oF) are skipped with their probe's reason (``pytest -rs`` shows it).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

from flatcake_ray.actors.protocol import node_actor_name  # noqa: E402
from flatcake_ray.client.calls import BoundNode  # noqa: E402
from flatcake_ray.client.client import FlatCakeClient  # noqa: E402
from flatcake_ray.client.nodes import NodeLink  # noqa: E402
from flatcake_ray.core.catalog import PutHints  # noqa: E402
from flatcake_ray.core.gva import Medium  # noqa: E402
from flatcake_ray.errors import ReadRangeError, ShapeError, TransportClosedError  # noqa: E402
from flatcake_ray.transports import base  # noqa: E402
from flatcake_ray.transports.base import ReadBatch  # noqa: E402
from flatcake_ray.transports.nixl_dram import NixlDramTransport  # noqa: E402
from flatcake_ray.transports.rdma_verbs import RdmaVerbsTransport  # noqa: E402
from flatcake_ray.transports.remote_ssd import NvmeofSsdTransport  # noqa: E402

NAMESPACE = "fc-contract"
LAYERS, PAGES, PAGE_BYTES = 3, 9, 5000  # odd sizes: layers are padded to 4 KiB strides

# (transport name, medium of its source, the probe that gates it)
CASES = [
    (base.LOCAL_DRAM, Medium.DRAM, None),
    (base.LOCAL_SSD, Medium.SSD, None),
    (base.REMOTE_DRAM_NIXL, Medium.DRAM, NixlDramTransport.probe),
    (base.REMOTE_DRAM_RDMA, Medium.DRAM, RdmaVerbsTransport.probe),
    (base.REMOTE_SSD_SHIPPED, Medium.SSD, NixlDramTransport.probe),
    (base.REMOTE_SSD_NVMEOF, Medium.SSD, NvmeofSsdTransport.probe),
    (base.OBJECT_STORE_FALLBACK, Medium.DRAM, None),
    (base.OBJECT_STORE_FALLBACK, Medium.SSD, None),
]
IDS = [f"{name}[{medium.name.lower()}]" for name, medium, _ in CASES]


@pytest.fixture(scope="module")
def source(ray_service):
    """A storage node with a DRAM and an SSD segment of known bytes, and their images."""
    config = ray_service(
        NAMESPACE,
        local={},
        layers=LAYERS,
        page_bytes=PAGE_BYTES,
        dram_bytes=4 << 20,
        ssd_file_bytes=4 << 20,
        ship_bytes=1 << 20,
    ).config
    client = FlatCakeClient(NAMESPACE)
    handle = ray.get_actor(node_actor_name(client.ray_node_id), namespace=NAMESPACE)
    rng = np.random.default_rng(7)
    images = {}
    leases: list[int] = []
    for medium, hints in (
        (Medium.DRAM, PutHints(turn=2, prior_reply_tokens=1)),
        (Medium.SSD, PutHints(turn=1)),
    ):
        kv = rng.integers(0, 256, (LAYERS, PAGES, PAGE_BYTES), dtype=np.uint8)
        keys = [f"{medium.name}-{i}" for i in range(PAGES)]
        assert client.put(keys, kv, session_id=medium.name, hints=hints).medium is medium
        # Held for the whole module: the owner serves bytes of leased ranges only.
        reply = ray.get(handle.lookup.remote(None, keys))
        (part,) = reply.parts
        image = np.zeros(LAYERS * part.layout.layer_stride, dtype=np.uint8)
        for layer in range(LAYERS):
            start = layer * part.layout.layer_stride
            image[start : start + part.layout.layer_bytes] = kv[layer].reshape(-1)
        images[medium] = (part.offset, image)
        leases.append(reply.lease_id)
    description = ray.get(handle.describe.remote(None))
    yield {
        "client": client,
        "handle": BoundNode(handle, None),  # the open default tenant's calls
        "description": description,
        "images": images,
        "config": config,
    }
    for lease_id in leases:
        assert ray.get(handle.release.remote(None, lease_id)) is True
    client.close()


def build(source, name: str, medium: Medium):
    """A fresh transport, made the way a client makes it; skipped with the probe's reason."""
    link = NodeLink(source["handle"], source["description"], False, source["config"])
    transport, _ = link.transport(name, medium, source["client"]._nixl_agent)
    return link, transport


@pytest.fixture(params=CASES, ids=IDS)
def case(request, source):
    name, medium, probe = request.param
    reason = probe() if probe is not None else None
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    link, transport = build(source, name, medium)
    offset, image = source["images"][medium]
    yield name, transport, offset, image
    link.close()


def ranges(offset: int, image: np.ndarray, seed: int = 0) -> tuple[ReadBatch, np.ndarray]:
    """Odd-sized, unaligned, out-of-order ranges of the image (and one whole layer)."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, image.size - 20_000, 12)
    lengths = rng.integers(1, 20_000, 12)
    starts, lengths = np.append(starts, 0), np.append(lengths, image.size // LAYERS)
    dst = np.cumsum(lengths) - lengths + 3  # 3: not at the start of dst either
    expected = np.zeros(int(dst[-1] + lengths[-1] + 5), dtype=np.uint8)
    for s, n, d in zip(starts, lengths, dst, strict=True):
        expected[d : d + n] = image[s : s + n]
    order = rng.permutation(len(starts))
    return ReadBatch(offset + starts[order], lengths[order], dst[order]), expected


def test_reads_every_range_byte_exact(case):
    name, transport, offset, image = case
    batch, expected = ranges(offset, image)
    dst = np.zeros_like(expected)
    stats = transport.read(batch, dst)
    assert np.array_equal(dst, expected)
    assert stats.path == transport.name == name
    assert stats.bytes >= batch.total_bytes and stats.commands >= 1 and stats.seconds >= 0


def test_repeated_reads_into_one_buffer_agree(case):
    _, transport, offset, image = case
    batch, expected = ranges(offset, image, seed=1)
    dst = np.zeros_like(expected)
    for _ in range(3):
        dst[:] = 0
        transport.read(batch, dst)
        assert np.array_equal(dst, expected)


def test_aligned_whole_strides_into_an_aligned_buffer(case):
    """The shape a restore asks for: every layer's whole (4 KiB padded) stride, packed into
    page-aligned staging (local SSD then reads straight into it)."""
    from flatcake_ray.media.buffers import AlignedBuffer

    _, transport, offset, image = case
    stride = image.size // LAYERS
    batch = ReadBatch.packed(offset + stride * np.arange(LAYERS), [stride] * LAYERS)
    staging = AlignedBuffer(image.size)
    transport.read(batch, staging.array)
    assert np.array_equal(staging.array[: image.size], image)


def test_empty_batch_moves_nothing(case):
    _, transport, _, _ = case
    dst = np.full(16, 7, dtype=np.uint8)
    stats = transport.read(ReadBatch([], [], []), dst)
    assert stats.bytes == 0 and (dst == 7).all()


def test_out_of_range_source_is_refused_before_any_byte_moves(case):
    _, transport, offset, _ = case
    dst = np.full(64, 7, dtype=np.uint8)
    batch = ReadBatch([offset, 1 << 40], [8, 8], [0, 8])
    with pytest.raises(ReadRangeError):
        transport.read(batch, dst)
    assert (dst == 7).all()


def test_bad_destinations_are_refused(case):
    _, transport, offset, _ = case
    with pytest.raises(ReadRangeError):  # past the end of dst
        transport.read(ReadBatch([offset], [64], [0]), np.zeros(32, dtype=np.uint8))
    with pytest.raises(ReadRangeError):  # two ranges overlap in dst
        transport.read(ReadBatch([offset, offset + 64], [32, 32], [0, 16]), np.zeros(64, np.uint8))
    with pytest.raises(ShapeError):  # not a 1-D uint8 buffer
        transport.read(ReadBatch([offset], [8], [0]), np.zeros(8, dtype=np.float32))


def test_a_closed_transport_refuses_reads(case):
    _, transport, offset, _ = case
    transport.close()
    transport.close()  # idempotent
    with pytest.raises(TransportClosedError):
        transport.read(ReadBatch([offset], [8], [0]), np.zeros(8, dtype=np.uint8))


def streaming(case):
    """The case's transport if it reads ahead; the others must refuse to open a stream."""
    _, transport, _, _ = case
    if not transport.reads_ahead:
        with pytest.raises(NotImplementedError):
            transport.open_stream([], threading.Lock())
        pytest.skip(f"{transport.name} does not read ahead")
    return transport


def test_a_stream_reads_the_announced_batches_in_order_with_one_call_to_open(case):
    transport = streaming(case)
    _, _, offset, image = case
    batches = [ranges(offset, image, seed) for seed in (3, 4, 5)]
    stream = transport.open_stream([batch for batch, _ in batches], threading.Lock())
    windows = sum(len(transport.windows(batch.nonempty())) for batch, _ in batches)
    try:
        with pytest.raises(ReadRangeError):  # not the next batch announced
            stream.read_next(batches[1][0], np.zeros_like(batches[1][1]))
        for batch, expected in batches:
            dst = np.zeros_like(expected)
            stats = stream.read_next(batch, dst)
            assert np.array_equal(dst, expected) and stats.bytes == batch.total_bytes
        with pytest.raises(ReadRangeError):  # nothing more was announced
            stream.read_next(batches[0][0], np.zeros_like(batches[0][1]))
    finally:
        stream.close()
    # One call opens it and a fire-and-forget unship frees each window: no round trip a window.
    assert stream.actor_calls == 1 + windows


def ship_regions_held(source) -> int:
    return ray.get(source["handle"].stats.remote())["ship_regions_held"]


def test_a_stream_stopped_early_gives_the_owner_its_buffer_back(case, source):
    """More windows than the owner's buffer holds: it reads ahead until full, waits for the
    reader, and a reader that stops after one batch frees everything it was shipped."""
    transport = streaming(case)
    _, _, offset, image = case
    whole = ReadBatch.packed([offset], [image.size])
    window = transport.windows(whole)[0].total_bytes
    repeats = 3 * source["config"].ship_bytes // window + 1  # three buffers' worth
    stream = transport.open_stream([whole] * repeats, threading.Lock())
    try:
        dst = np.zeros(image.size, dtype=np.uint8)
        stream.read_next(whole, dst)
        assert np.array_equal(dst, image)
    finally:
        stream.close()
    deadline = time.monotonic() + 10
    while ship_regions_held(source) and time.monotonic() < deadline:
        time.sleep(0.05)  # the unships are fire-and-forget
    assert ship_regions_held(source) == 0
    with transport.open_stream([whole], threading.Lock()) as again:  # the buffer is usable
        again.read_next(whole, dst)


def test_a_stream_of_ranges_the_reader_holds_no_lease_on_is_refused(case, source):
    transport = streaming(case)
    _, _, offset, image = case
    unleased = ReadBatch([offset + image.size + (64 << 10)], [4096], [0])
    stream = transport.open_stream([unleased], threading.Lock())
    dst = np.full(4096, 7, dtype=np.uint8)
    try:
        with pytest.raises(ReadRangeError):
            stream.read_next(unleased, dst)
    finally:
        stream.close()
    assert (dst == 7).all()


def test_every_remote_path_is_either_probed_usable_or_says_why():
    for name, _, probe in CASES:
        if probe is not None:
            reason = probe()
            assert reason is None or (isinstance(reason, str) and reason), name


def test_service_agents_run_without_a_spinning_progress_thread():
    """Readers progress their own requests; owners are pumped: no agent spins a core."""
    if NixlDramTransport.probe() is not None:
        pytest.skip(f"nixl: {NixlDramTransport.probe()}")
    from flatcake_ray.actors.nixl_roles import exporter_agent, reader_agent
    from flatcake_ray.transports.nixl_agent import unique_agent_name

    agents = [reader_agent(unique_agent_name("r")), exporter_agent(unique_agent_name("e"))]
    try:
        assert [agent.progress for agent in agents] == ["none", "pump"]
    finally:
        for agent in agents:
            agent.close()


def test_local_ssd_reads_planned_ranges_as_given_aligned_ones_without_a_bounce(
    tmp_path, monkeypatch
):
    """Coalescing is the plan's: the transport issues one command per range, straight into
    the destination when the range and the destination are aligned."""
    from flatcake_ray.media import buffers
    from flatcake_ray.media.buffers import AlignedBuffer
    from flatcake_ray.media.pool import SsdPool
    from flatcake_ray.transports.local_ssd import LocalSsdTransport

    pool = SsdPool((str(tmp_path),), 1, 1 << 20)
    data = AlignedBuffer(1 << 20)
    data.array[:] = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    pool.write(0, data.array)
    transport = LocalSsdTransport(pool)
    try:
        staging = AlignedBuffer(1 << 20)
        bounces: list[int] = []
        real_init = buffers.AlignedBuffer.__init__

        def counting_init(self, nbytes):
            bounces.append(nbytes)
            real_init(self, nbytes)

        monkeypatch.setattr(buffers.AlignedBuffer, "__init__", counting_init)
        batch = ReadBatch.packed(np.arange(8) * (128 << 10), [128 << 10] * 8)
        stats = transport.read(batch, staging.array)
        assert np.array_equal(staging.array, data.array)
        assert stats.commands == 8 and bounces == []  # one command a range, never bounced
        unaligned = np.zeros((1 << 20) + 1, dtype=np.uint8)[1:]
        transport.read(batch, unaligned)
        assert np.array_equal(unaligned, data.array)
    finally:
        transport.close()
        pool.close()


def test_an_nvmeof_view_needs_the_whole_pool_visible_and_reads_like_local(tmp_path):
    """The remote-ssd-nvmeof code path: the owner's pool files under ``nvmeof_root`` (here a
    plain folder standing in for an exported namespace), read with the local-SSD code."""
    from flatcake_ray.media.buffers import AlignedBuffer
    from flatcake_ray.media.pool import SsdPool
    from flatcake_ray.transports.remote_ssd import visible_pool

    owner_pool = SsdPool((str(tmp_path / "7"),), 2, 1 << 20)
    data = AlignedBuffer(1 << 20)
    data.array[:] = 42
    owner_pool.write(1 << 20, data.array)
    template = str(tmp_path / "{node_id}")
    paths, reason = visible_pool(template, 7, tuple(owner_pool.paths), 1 << 20)
    assert reason is None and paths == owner_pool.paths
    assert visible_pool(template, 8, tuple(owner_pool.paths), 1 << 20)[0] is None
    assert visible_pool("", 7, tuple(owner_pool.paths), 1 << 20)[1] == "no nvmeof_root configured"
    transport = NvmeofSsdTransport.open(paths, 1 << 20)
    try:
        dst = np.zeros(100, dtype=np.uint8)
        stats = transport.read(ReadBatch([(1 << 20) + 5], [100], [0]), dst)
        assert (dst == 42).all() and stats.path == base.REMOTE_SSD_NVMEOF
    finally:
        transport.close()
        owner_pool.close()


@pytest.mark.gpu
def test_gds_reads_pool_ranges_into_gpu_memory(tmp_path):
    from flatcake_ray.transports.local_ssd import GdsSsdTransport

    reason = GdsSsdTransport.probe()
    if reason is not None:
        pytest.skip(f"local-ssd-gds: {reason}")
    import torch

    from flatcake_ray.media.buffers import AlignedBuffer
    from flatcake_ray.media.pool import SsdPool

    pool = SsdPool((str(tmp_path),), 1, 1 << 20)
    data = AlignedBuffer(1 << 20)
    data.array[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
    pool.write(0, data.array)
    pool.close()
    transport = GdsSsdTransport(pool.paths, 1 << 20)
    try:
        dst = torch.zeros(8192, dtype=torch.uint8, device="cuda")
        transport.read(ReadBatch([4096, 100], [4096, 50], [0, 4096]), dst)
        host = dst.cpu().numpy()
        assert np.array_equal(host[:4096], data.array[4096:8192])
        assert np.array_equal(host[4096:4146], data.array[100:150])
    finally:
        transport.close()
