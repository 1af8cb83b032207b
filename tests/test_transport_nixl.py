"""Real NIXL/UCX reads between two processes over loopback (the interface without a peer is
in ``test_transport_batches.py``).

The owner of an arena runs in a second process (spawned, so it has its own UCX context) and
exports its arena; this process reads ranges of it. UCX is pinned to the loopback device.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from flatcake_ray.errors import (
    PeerDisconnectedError,
    ReadRangeError,
    ShapeError,
    TransferError,
    TransferTimeoutError,
    TransportClosedError,
)
from flatcake_ray.transports.base import REMOTE_DRAM_NIXL, ReadBatch
from flatcake_ray.transports.nixl_agent import PUMP_IDLE_S, NixlAgent, unique_agent_name
from flatcake_ray.transports.nixl_dram import NixlDramTransport, NixlPeerInfo

ARENA_BYTES = 256 << 20
LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo"}
START_TIMEOUT_S = 120.0


def pattern(size: int, seed: int) -> np.ndarray:
    """Bytes that differ at every offset scale, so a misplaced range cannot match."""
    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8)


# --------------------------------------------------------------------------- owner process


def _owner_main(conn, size: int, seed: int, name: str | None, progress: str) -> None:
    """Child: export an arena holding ``pattern(size, seed)`` from an agent progressed as
    ``progress`` says; serve until told to stop."""
    from flatcake_ray.transports.nixl_dram import NixlArenaExporter

    os.environ.update(LOOPBACK_ENV)
    os.environ.pop("UCX_TLS", None)  # the owner offers every transport; readers choose
    try:
        agent = NixlAgent(name or unique_agent_name("owner"), progress=progress)
        exporter = NixlArenaExporter(agent.name, pattern(size, seed), agent=agent)
    except BaseException as exc:
        conn.send(repr(exc))
        raise
    with exporter:
        conn.send(exporter.peer_info())
        with contextlib.suppress(EOFError):  # EOF: the parent died, so stop too
            conn.recv()
    agent.close()


class Owner:
    def __init__(
        self, size: int, seed: int, name: str | None = None, progress: str = "thread"
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        args = (child_conn, size, seed, name, progress)
        self.process = context.Process(target=_owner_main, args=args)
        self.process.start()
        child_conn.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self.stop()
            pytest.fail("the arena owner did not start in time")
        message = self._conn.recv()
        if not isinstance(message, NixlPeerInfo):
            self.stop()
            pytest.fail(f"the arena owner failed: {message}")
        self.info: NixlPeerInfo = message
        self.arena = pattern(size, seed)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):  # dying anyway: join decides
                self._conn.send("stop")
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(30)
        self._conn.close()


@pytest.fixture(scope="module")
def nixl_usable():
    reason = NixlDramTransport.probe()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def owner(nixl_usable):
    with pytest.MonkeyPatch.context() as env:
        for key, value in LOOPBACK_ENV.items():
            env.setenv(key, value)
        arena_owner = Owner(ARENA_BYTES, seed=1)
    yield arena_owner
    arena_owner.stop()


@pytest.fixture
def spawn_owner(nixl_usable, monkeypatch):
    """Owners a test may kill; each is stopped at the end."""
    for key, value in LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)
    owners: list[Owner] = []

    def spawn(size: int, seed: int = 2, **kwargs) -> Owner:
        owners.append(Owner(size, seed, **kwargs))
        return owners[-1]

    yield spawn
    for arena_owner in owners:
        arena_owner.stop()


@pytest.fixture(params=["tcp", "any"])
def reader_agent(request, nixl_usable, monkeypatch):
    """A local agent over UCX's TCP transport on lo, or over whatever UCX picks (shm/cma)."""
    for key, value in LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)
    agent = agent_over(None if request.param == "any" else request.param, monkeypatch)
    yield agent
    agent.close()


def agent_over(tls: str | None, monkeypatch, progress: str = "thread") -> NixlAgent:
    """An agent whose UCX context uses ``tls`` (None: whatever UCX picks)."""
    if tls is None:
        monkeypatch.delenv("UCX_TLS", raising=False)
    else:
        monkeypatch.setenv("UCX_TLS", tls)
    return NixlAgent(unique_agent_name(f"reader-{tls or 'any'}"), progress=progress)


def scattered_batch(rng: np.random.Generator, arena_bytes: int, count: int) -> ReadBatch:
    """Ranges at both ends of the arena and of varied sizes elsewhere, laid out in dst in a
    shuffled order with gaps (so a range landing at the wrong place shows)."""
    lengths = rng.integers(1, 256 << 10, size=count)
    lengths[:5] = [1, 4096, 1, 65536, arena_bytes // 4]
    src = rng.integers(0, arena_bytes - lengths)
    src[:5] = [0, 0, arena_bytes - 1, arena_bytes - 65536, arena_bytes // 3]
    slots = rng.permutation(count)
    gaps = rng.integers(0, 64, size=count)
    ends = np.cumsum(lengths[slots] + gaps[slots])
    dst = np.empty(count, dtype=np.int64)
    dst[slots] = ends - lengths[slots]
    return ReadBatch(src, lengths, dst)


def assert_landed(batch: ReadBatch, arena: np.ndarray, dst: np.ndarray, sentinel: int) -> None:
    """Every range holds its source bytes and nothing outside the ranges was touched."""
    expected = np.full(dst.size, sentinel, dtype=np.uint8)
    for s, n, d in zip(batch.src_offsets, batch.lengths, batch.dst_offsets, strict=True):
        expected[d : d + n] = arena[s : s + n]
    if not np.array_equal(dst, expected):
        first = int(np.flatnonzero(dst != expected)[0])
        pytest.fail(f"dst differs from the expected bytes first at offset {first}")


# --------------------------------------------------------------------------- NIXL reads


def test_probe_finds_nixl_here():
    assert NixlDramTransport.probe() is None


def test_scattered_reads_land_exactly(owner, reader_agent):
    rng = np.random.default_rng(7)
    batch = scattered_batch(rng, ARENA_BYTES, count=300)
    dst = np.full(int((batch.dst_offsets + batch.lengths).max()) + 100, 0xA5, dtype=np.uint8)
    with NixlDramTransport(reader_agent, owner.info, timeout_s=60) as transport:
        stats = transport.read(batch, dst)
        assert_landed(batch, owner.arena, dst, 0xA5)
        assert (stats.bytes, stats.commands, stats.path) == (
            batch.total_bytes,
            300,
            REMOTE_DRAM_NIXL,
        )
        again = ReadBatch.packed([5, ARENA_BYTES - 3], [3, 3], dst_start=10)
        transport.read(again, dst[:100])  # a slice reuses the whole buffer's registration
        np.testing.assert_array_equal(dst[10:16], np.r_[owner.arena[5:8], owner.arena[-3:]])
        assert len(reader_agent.destinations) == 1
        empty = transport.read(ReadBatch([], [], []), dst)
        assert (empty.bytes, empty.commands) == (0, 0)


def test_out_of_range_reads_are_rejected_before_posting(owner, reader_agent):
    dst = np.full(4096, 0x5A, dtype=np.uint8)
    with NixlDramTransport(reader_agent, owner.info) as transport:
        with pytest.raises(ReadRangeError, match="ends past"):
            transport.read(ReadBatch([ARENA_BYTES - 10], [11], [0]), dst)
        with pytest.raises(ReadRangeError):
            transport.read(ReadBatch([0], [4097], [0]), dst)
        with pytest.raises(ShapeError):
            transport.read(ReadBatch([0], [16], [0]), dst.view(np.int8))
        assert len(reader_agent.destinations) == 0  # nothing was even registered
        assert np.all(dst == 0x5A)
        transport.read(ReadBatch([ARENA_BYTES - 10], [10], [0]), dst)  # still usable
        np.testing.assert_array_equal(dst[:10], owner.arena[-10:])


def test_transport_closes_cleanly(owner, nixl_usable, monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    transport = NixlDramTransport(unique_agent_name("closer"), owner.info)
    dst = np.zeros(64, np.uint8)
    transport.read(ReadBatch([0], [64], [0]), dst)
    transport.close()
    transport.close()
    with pytest.raises(TransportClosedError):
        transport.read(ReadBatch([0], [64], [0]), dst)


def wait_until_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    pytest.fail(f"process {pid} did not stop")


def test_stalled_or_dead_peer_gives_typed_errors_not_hangs(spawn_owner, monkeypatch):
    """A stalled owner (SIGSTOP) times out; a dead one (SIGKILL) fails at once; neither hangs.
    One owner serves both cases: starting one costs seconds (nixl imports torch)."""
    victim = spawn_owner(size=16 << 20)
    dst = np.zeros(16 << 20, np.uint8)
    whole = ReadBatch([0], [dst.size], [0])
    tcp_agent, any_agent = agent_over("tcp", monkeypatch), agent_over(None, monkeypatch)
    # Over TCP UCX emulates READ with the owner's progress thread, so stopping it stalls reads.
    stalled = NixlDramTransport(tcp_agent, victim.info, timeout_s=1.0)
    survivor = NixlDramTransport(any_agent, victim.info, timeout_s=10)
    try:
        for transport in (stalled, survivor):
            dst[:] = 0
            transport.read(whole, dst)
            np.testing.assert_array_equal(dst, victim.arena)

        os.kill(victim.process.pid, signal.SIGSTOP)
        wait_until_stopped(victim.process.pid)
        started = time.monotonic()
        with pytest.raises(TransferTimeoutError):
            stalled.read(whole, dst)
        assert time.monotonic() - started < 5
        assert stalled.broken and not survivor.broken
        with pytest.raises(TransferError, match="build a new one"):  # a timeout breaks it
            stalled.read(ReadBatch([0], [16], [0]), dst)

        os.kill(victim.process.pid, signal.SIGKILL)
        victim.process.join(30)
        started = time.monotonic()
        with pytest.raises(TransferError) as raised:
            survivor.read(ReadBatch([0], [4096], [0]), dst)
        elapsed = time.monotonic() - started
        print(f"dead peer -> {type(raised.value).__name__} after {elapsed * 1e3:.1f} ms")
        assert elapsed < 12
        with pytest.raises(PeerDisconnectedError):  # and nobody can connect to it any more
            NixlDramTransport(tcp_agent, victim.info)
    finally:
        for closeable in (stalled, survivor, tcp_agent, any_agent):
            closeable.close()


def test_quiet_agents_read_from_a_pumped_owner_over_tcp(spawn_owner, monkeypatch):
    """Readers without a progress thread read from an owner progressed only by its pump,
    over TCP too (where UCX emulates READ with the owner's progress); the pump stops on close."""
    with pytest.raises(ValueError, match="progress"):
        NixlAgent("bad", progress="busy")
    victim = spawn_owner(size=4 << 20, progress="pump")
    for tls in ("tcp", None):
        agent = agent_over(tls, monkeypatch, progress="none")
        dst = np.zeros(victim.arena.size, np.uint8)
        with NixlDramTransport(agent, victim.info, timeout_s=20) as transport:
            transport.read(ReadBatch([0], [dst.size], [0]), dst)
        agent.close()
        np.testing.assert_array_equal(dst, victim.arena)
    pumped = NixlAgent(unique_agent_name("pumped"), progress="pump")
    pump = pumped._pump
    assert pump is not None and pump.is_alive()
    pumped.close()
    assert not pump.is_alive()


def test_an_idle_pump_polls_slowly_and_at_full_rate_while_peers_hold_memory():
    """An owner's pump with nothing out to peers polls every PUMP_IDLE_S, not 2,000 times a
    second (a bound that a loaded machine only helps: it can poll less, never more); while
    ``busy`` says peers hold memory it polls far more often than that; close stops it."""
    state = {"busy": False, "polls": 0}

    def busy() -> bool:
        state["polls"] += 1  # asked once per poll that found no wake pending
        return bool(state["busy"])

    agent = NixlAgent(unique_agent_name("idle"), progress="pump", busy=busy)
    pump = agent._pump
    idle_bound = 2 * (1 / PUMP_IDLE_S + 2)  # polls in 2 s, with room for the first
    try:
        before = state["polls"]
        time.sleep(2.0)
        assert state["polls"] - before <= idle_bound
        state["busy"] = True
        before = state["polls"]
        time.sleep(2.0)
        assert state["polls"] - before > 2 * idle_bound
    finally:
        agent.close()
    assert pump is not None and not pump.is_alive()


def test_writes_land_in_the_owners_memory_and_stay_in_range(spawn_owner, reader_agent):
    """A put's one-sided WRITE: the bytes are at the owner when write returns (read back over
    the same agent), a range past the export is refused before posting, and a writer whose
    owner died says so with a typed error."""
    from flatcake_ray.transports.nixl_write import NixlDramWriter

    target = spawn_owner(size=1 << 20, seed=5)
    src = np.arange(8192, dtype=np.uint8) ^ 0x3C
    writer = NixlDramWriter(reader_agent, target.info, timeout_s=30)
    stats = writer.write(src[:4096], 12288)
    assert (stats.bytes, stats.commands, stats.path) == (4096, 1, REMOTE_DRAM_NIXL)
    back = np.zeros(4096, dtype=np.uint8)
    with NixlDramTransport(reader_agent, target.info) as reader:
        reader.read(ReadBatch([12288], [4096], [0]), back)
        np.testing.assert_array_equal(back, src[:4096])
        reader.read(ReadBatch([0], [4096], [0]), back)  # a neighbour is untouched
        np.testing.assert_array_equal(back, target.arena[:4096])
    with pytest.raises(ReadRangeError):
        writer.write(src, (1 << 20) - 4096)
    target.process.kill()
    target.process.join(30)
    with pytest.raises(TransferError):
        for _ in range(50):  # UCX notices the dead peer within a few attempts
            writer.write(src[:4096], 0)
            time.sleep(0.1)
    assert writer.broken
    writer.close()


def test_large_read_bandwidth(owner, reader_agent, request):
    dst = np.ones(ARENA_BYTES, np.uint8)  # pages faulted in before timing
    batch = ReadBatch([0], [ARENA_BYTES], [0])
    with NixlDramTransport(reader_agent, owner.info, timeout_s=120) as transport:
        transport.read(ReadBatch([0], [1], [0]), dst)  # connects and registers dst
        runs = [transport.read(batch, dst) for _ in range(2)]
    assert np.array_equal(dst, owner.arena)
    tls = request.node.callspec.params["reader_agent"]
    rates = ", ".join(f"{run.gb_per_s:.2f}" for run in runs)
    print(f"NIXL READ of 256 MiB over loopback, UCX_TLS={tls}: {rates} GB/s")


def test_nixl_itself_refuses_a_write_to_memory_its_peer_did_not_register(nixl_usable, monkeypatch):
    """What per-tenant registration would rest on (``docs/security.md``, left from issue 23):
    a WRITE whose remote descriptor lies in memory the target agent did not register (here
    another tenant's chunk, in the same process) is refused by NIXL when the transfer is
    made, before anything is posted; the same WRITE into registered memory lands."""
    from flatcake_ray.transports.nixl_agent import buffer_address

    for key, value in LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)
    owner_agent = agent_over("tcp", monkeypatch)
    writer = agent_over("tcp", monkeypatch)
    registered, other = np.zeros(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
    try:
        owner_agent.register(registered)
        peer = writer.add_peer(owner_agent.metadata())
        src = np.full(4096, 7, np.uint8)
        writer.register(src)
        local = np.array([[buffer_address(src), 4096, 0]], dtype=np.uint64)
        for target in (registered, other):
            remote = np.array([[buffer_address(target), 4096, 0]], dtype=np.uint64)
            if target is registered:
                writer.write(peer, local, remote, timeout_s=30, src=src)
            else:
                with pytest.raises(TransferError, match="NOT_FOUND"):
                    writer.write(peer, local, remote, timeout_s=30, src=src)
        assert registered[:4096].tolist() == [7] * 4096 and not other.any()
    finally:
        writer.close()
        owner_agent.close()


CHUNK = 1 << 20


def test_a_peer_given_some_chunks_reaches_those_and_nixl_refuses_the_rest(nixl_usable, monkeypatch):
    """Per-tenant NIXL (issue 23): an exporter registers each chunk on its own and gives a
    peer the metadata of the chunks it names only. The peer reads and writes those; a read
    or write elsewhere is refused by the transport (``ForeignMemoryError``), and, when the
    transport's own check is bypassed with a descriptor the peer was not given, by NIXL
    itself, nothing posted. Chunks given later (``refresh``) are learnt, and a read across
    two of them is cut at their border (one registration each)."""
    from flatcake_ray.errors import ForeignMemoryError
    from flatcake_ray.transports.nixl_dram import NixlArenaExporter, descriptors
    from flatcake_ray.transports.nixl_write import NixlDramWriter

    for key, value in LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)
    owner = agent_over("tcp", monkeypatch)
    arena = pattern(4 * CHUNK, 5).copy()
    exporter = NixlArenaExporter(owner.name, arena, agent=owner, chunk_bytes=CHUNK)
    given = [0]
    reader = NixlDramTransport(
        agent_over("tcp", monkeypatch),
        exporter.peer_info(given),
        refresh=lambda: exporter.peer_info(given),
    )
    writer = NixlDramWriter(agent_over("tcp", monkeypatch), exporter.peer_info([2 * CHUNK]))
    out = np.zeros(CHUNK, np.uint8)
    try:
        reader.read(ReadBatch([100], [4096], [0]), out)
        assert np.array_equal(out[:4096], arena[100:4196])
        with pytest.raises(ForeignMemoryError):  # chunk 1: not given
            reader.read(ReadBatch([CHUNK + 100], [4096], [0]), out)
        agent = reader._live_agent  # past the transport's check: NIXL's own
        with agent.destinations.use(out), pytest.raises(TransferError, match="NOT_FOUND"):
            local = descriptors(np.array([out.ctypes.data]), np.array([64]))
            remote = descriptors(np.array([exporter.base_address + 3 * CHUNK]), np.array([64]))
            agent.read(reader._peer_name, local, remote, "DRAM", timeout_s=30, dst=out)
        given.append(CHUNK)  # its tenant took chunk 1: learnt on the next read beyond
        reader.read(ReadBatch([CHUNK - 2048], [4096], [0]), out)  # across the border
        assert np.array_equal(out[:4096], arena[CHUNK - 2048 : CHUNK + 2048])
        data = np.full(4096, 9, np.uint8)
        writer.write(data, 2 * CHUNK + 8192)
        assert np.array_equal(arena[2 * CHUNK + 8192 : 2 * CHUNK + 12288], data)
        for offset in (0, 3 * CHUNK):  # chunks the writer was not given
            with pytest.raises(ForeignMemoryError):
                writer.write(data, offset)
        assert not np.array_equal(arena[:4096], data[:4096])
    finally:
        reader.close()
        writer.close()
        exporter.close()
        owner.close()


@pytest.mark.parametrize("tls", [None, "tcp"], ids=["ucx-default", "tcp"])
def test_a_renewed_chunk_is_read_from_its_fresh_file(nixl_usable, monkeypatch, tls):
    """A chunk that changed tenants has a fresh file mapped where the old one was
    (``DramArena.renew_chunk``) and is registered again (``NixlArenaExporter.renew``): a peer
    given the chunk now READs and WRITEs the fresh file's bytes, never the retired one's."""
    from flatcake_ray.media.arena import DramArena
    from flatcake_ray.transports.nixl_dram import NixlArenaExporter
    from flatcake_ray.transports.nixl_write import NixlDramWriter

    for key, value in LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)
    owner = agent_over(tls, monkeypatch)
    arena = DramArena(2 * CHUNK, f"renew-{tls}-{os.getpid()}", "off", CHUNK)
    exporter = NixlArenaExporter(owner.name, arena.view, agent=owner, chunk_bytes=CHUNK)
    arena.on_renewed.append(exporter.renew)
    arena.write(CHUNK, pattern(CHUNK, 1))  # the former tenant's bytes
    arena.renew_chunk(1)
    arena.write(CHUNK, pattern(CHUNK, 2))  # the next tenant's, in the fresh file
    reader = NixlDramTransport(agent_over(tls, monkeypatch), exporter.peer_info([CHUNK]))
    writer = NixlDramWriter(agent_over(tls, monkeypatch), exporter.peer_info([CHUNK]))
    out = np.zeros(CHUNK, np.uint8)
    try:
        reader.read(ReadBatch([CHUNK], [CHUNK], [0]), out)
        assert np.array_equal(out, pattern(CHUNK, 2))
        writer.write(np.full(4096, 7, np.uint8), CHUNK + 8192)
        assert (arena.view[CHUNK + 8192 : CHUNK + 12288] == 7).all()
    finally:
        reader.close()
        writer.close()
        exporter.close()
        owner.close()
        arena.close()


def test_over_tcp_the_owner_side_checks_nothing_a_stale_descriptor_still_reads(
    nixl_usable, monkeypatch
):
    """What ``docs/security.md`` says NIXL over UCX's TCP emulation does not protect: the
    check is the initiator's. A peer that loaded the metadata of a region READs it still
    after the owner deregistered it (on RDMA the NIC would refuse the dead remote key). If
    this ever fails, UCX checks at the target now: update the threat model."""
    from flatcake_ray.transports.nixl_dram import descriptors

    for key, value in LOOPBACK_ENV.items():
        monkeypatch.setenv(key, value)
    owner, reader = agent_over("tcp", monkeypatch), agent_over("tcp", monkeypatch)
    region, out = pattern(1 << 20, 8).copy(), np.zeros(4096, np.uint8)
    try:
        registration = owner.register(region)
        peer = reader.add_peer(owner.metadata())
        owner.deregister(registration)
        local = descriptors(np.array([out.ctypes.data]), np.array([4096]))
        remote = descriptors(np.array([region.ctypes.data]), np.array([4096]))
        with reader.destinations.use(out):
            reader.read(peer, local, remote, "DRAM", timeout_s=30, dst=out)
        assert np.array_equal(out, region[:4096])
    finally:
        reader.close()
        owner.close()
