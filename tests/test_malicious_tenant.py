"""One malicious tenant on the victim's node (issue 23).

First, what it cannot reach: a tenant's client is handed its own tenant's memory only (arena
and landing chunks as descriptors; no chunk has a path), is refused any other chunk it asks
for, and a process of the service's OS user without privileges cannot open the storage
node's descriptors or memory through ``/proc`` (the node is non-dumpable), while the same
probe opens those of a dumpable process of that user (the control).

Then a chaos soak: it writes garbage into everything it can reach (its own arena and landing
chunks, mapped shared and writable; the SSD pool files, which any process of the service's
OS user can open by path), all the time, while another tenant puts and restores DRAM and SSD
pages. The victim gets 0 wrong bytes: its puts commit or fail with ``TamperedWriteError``,
and its restores deliver its own bytes or miss (bounded: ``ROUNDS`` rounds, at most
``SOAK_S`` seconds). And what it reads by path: the pool files hold a tenant's SSD pages
sealed under a key derived from that tenant's secret, so another tenant's process that
opens them finds none of the victim's bytes there, while the victim restores them."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from flatcake_ray.actors.protocol import PutMemory
from flatcake_ray.client.put_targets import map_shared
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.errors import ForeignMemoryError, TamperedWriteError, TransferError
from flatcake_ray.transports.base import LOCAL_SSD
from tests.conftest import LAYERS, PAGE_BYTES, SMALL_SERVICE, lines_found, marked_kv
from tests.same_user import opened_through_proc

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

NAMESPACE = "fc-malicious"
DRAM = PutHints(turn=2, prior_reply_tokens=1)
SSD = PutHints(turn=1)
ROUNDS = 24
SOAK_S = 120.0
KEPT = 6  # rounds of the victim's pages read back each round


def kv(pages: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (LAYERS, pages, PAGE_BYTES), np.uint8)


@pytest.fixture(scope="module")
def service(ray_service):
    from flatcake_ray.client import tenants
    from flatcake_ray.client.client import FlatCakeClient
    from flatcake_ray.config import ClientConfig

    ray_service(NAMESPACE, local={}, **SMALL_SERVICE, landing_bytes=4 << 20, ramp_seconds=0.0)
    clients = {
        name: FlatCakeClient(
            NAMESPACE,
            config=ClientConfig(
                tenant_secret=tenants.add_tenant(
                    NAMESPACE, name, layers=LAYERS, page_bytes=PAGE_BYTES, timeout_s=60.0
                )
            ),
        )
        for name in ("victim", "mallory")
    }
    yield clients
    for client in clients.values():
        client.close()


def description_landing(links) -> int:
    return ray.get(links["mallory"].handle.service_config.remote(), timeout=30).landing_bytes


def test_a_tenant_is_handed_its_own_arena_chunks_and_reads_no_other(service):
    from flatcake_ray.transports.base import ReadBatch
    from flatcake_ray.transports.local_dram import LocalDramTransport

    links = {name: client.nodes.links[1] for name, client in service.items()}
    for name, client in service.items():
        client.put([f"{name}/own/{i}" for i in range(2)], kv(2, 3), hints=DRAM)
    described = {
        name: {c.offset for c in ray.get(link.handle.describe.remote(), timeout=30).arena_chunks}
        for name, link in links.items()
    }
    assert described["victim"] and described["mallory"]
    assert not described["victim"] & described["mallory"]
    handed = links["mallory"].hand_chunks("arena")  # the descriptors: its own chunks only
    for chunk in handed:
        os.close(chunk.fd)
    assert {chunk.offset for chunk in handed} == described["mallory"]
    with pytest.raises(ForeignMemoryError):  # asking for the victim's by offset: refused
        links["mallory"].hand_chunks("arena", sorted(described["victim"]))
    ticket = ray.get(links["mallory"].handle.begin_put.remote(["m/t0"], hints=DRAM), timeout=30)
    try:
        target = ticket.target
        assert target.memory is PutMemory.ARENA and target.chunk_offset in described["mallory"]
        for offset in target.offsets:  # every layer inside the one chunk named with it
            assert target.chunk_offset <= offset < target.chunk_offset + target.nbytes
    finally:
        ray.get(links["mallory"].handle.abort_put.remote(ticket.put_id), timeout=30)
    ssd = ray.get(links["mallory"].handle.begin_put.remote(["m/t1"], hints=SSD), timeout=30)
    try:  # an SSD put's slots: in one landing chunk, the one its ticket names
        target = ssd.target
        assert target.memory is PutMemory.LANDING
        assert target.nbytes < description_landing(links)
        for offset in target.offsets:
            assert target.chunk_offset <= offset < target.chunk_offset + target.nbytes
        with pytest.raises(ForeignMemoryError):  # another landing chunk: not its own
            links["mallory"].hand_chunks("landing", [target.chunk_offset + target.nbytes])
    finally:
        ray.get(links["mallory"].handle.abort_put.remote(ssd.put_id), timeout=30)
    arena_bytes = links["mallory"].description.arena_bytes
    reader = LocalDramTransport.attach(lambda: links["mallory"].hand_chunks("arena"), arena_bytes)
    try:
        victims = min(described["victim"])
        with pytest.raises(ForeignMemoryError):  # the victim's chunk: not mapped, refused
            reader.read(ReadBatch([victims], [64], [0]), np.zeros(64, np.uint8))
    finally:
        reader.close()


def test_a_former_tenants_mapping_reaches_nothing_of_the_next_tenant(service):
    """A tenant's client maps its chunk and keeps the mapping after its tenant is gone; the
    chunk goes to the victim (a fresh file): the mapping shows none of the victim's bytes,
    and garbage written through it reaches none of the victim's reads."""
    from flatcake_ray.client import tenants
    from flatcake_ray.client.client import FlatCakeClient
    from flatcake_ray.config import ClientConfig

    secret = tenants.add_tenant(
        NAMESPACE, "leaver", layers=LAYERS, page_bytes=PAGE_BYTES, timeout_s=60.0
    )
    leaver = FlatCakeClient(NAMESPACE, config=ClientConfig(tenant_secret=secret))
    try:
        leaver.put([f"leaver/{i}" for i in range(4)], kv(4, 5), hints=DRAM)
        handed = leaver.nodes.links[1].hand_chunks("arena")
        kept = {chunk.offset: map_shared(chunk.fd, chunk.nbytes) for chunk in handed}
        for chunk in handed:
            os.close(chunk.fd)
    finally:
        leaver.close()
    tenants.remove_tenant(NAMESPACE, "leaver", timeout_s=60.0)  # its chunk is free
    victim, link = service["victim"], service["victim"].nodes.links[1]
    stored: dict[str, np.ndarray] = {}
    for round_ in range(24):  # until the victim holds a chunk the leaver held
        held = {c.offset for c in ray.get(link.handle.describe.remote(), timeout=30).arena_chunks}
        if held & set(kept):
            break
        stored[f"heir{round_}"] = data = kv(16, 100 + round_)
        victim.put([f"heir{round_}/{i}" for i in range(16)], data, hints=DRAM)
    (offset,) = held & set(kept)
    former = kept[offset][1]
    assert not former.any()  # the leaver's mapping: its own pages gone, none of the victim's
    former[:] = 0xAB  # and what it writes there lands nowhere the victim reads
    for name, data in stored.items():
        out = np.zeros_like(data)
        count = victim.get([f"{name}/{i}" for i in range(data.shape[1])], out)
        assert np.array_equal(out[:, :count], data[:, :count])
    assert any(  # and its pages are hits: the check above compared bytes, not just misses
        victim.get([f"{name}/{i}" for i in range(16)], np.zeros_like(data)) == 16
        for name, data in stored.items()
    )


def test_a_tenant_is_given_the_nixl_metadata_of_its_own_chunks_only(service):
    """Over NIXL (another machine's path) too: the arena is registered a chunk at a time and
    a tenant is given the metadata of its own chunks only, in ``describe`` and in a put's
    ticket. It reads its own pages; the victim's chunk is refused by the transport and, with
    a descriptor it was not given, by NIXL itself."""
    from flatcake_ray.core.gva import decode
    from flatcake_ray.transports.base import ReadBatch
    from flatcake_ray.transports.nixl_agent import unique_agent_name
    from flatcake_ray.transports.nixl_dram import NixlDramTransport, descriptors

    links = {name: client.nodes.links[1] for name, client in service.items()}
    data = kv(2, 21)
    service["mallory"].put(["m/nixl/0", "m/nixl/1"], data, hints=DRAM)
    service["victim"].put(["v/nixl/0"], kv(1, 22), hints=DRAM)
    described = {n: ray.get(link.handle.describe.remote(), timeout=30) for n, link in links.items()}
    peer = described["mallory"].arena_nixl
    if peer is None:
        pytest.skip(f"the node exports no NIXL here: {described['mallory'].nixl_reason}")
    assert set(peer.chunks) == {(c.offset, c.nbytes) for c in described["mallory"].arena_chunks}
    victims = described["victim"].arena_chunks[0]
    at = decode(int(service["mallory"].gvas(["m/nixl/0"])[0])).offset
    reader = NixlDramTransport(unique_agent_name("mallory"), peer)
    out = np.zeros(PAGE_BYTES, np.uint8)
    try:
        reader.read(ReadBatch([at], [PAGE_BYTES], [0]), out)  # layer 0 of its page
        assert np.array_equal(out, data[0, 0])
        with pytest.raises(ForeignMemoryError):
            reader.read(ReadBatch([victims.offset], [64], [0]), out)
        agent = reader._live_agent
        with agent.destinations.use(out), pytest.raises(TransferError, match="NOT_FOUND"):
            local = descriptors(np.array([out.ctypes.data]), np.array([64]))
            remote = descriptors(np.array([peer.base_address + victims.offset]), np.array([64]))
            agent.read(reader._peer_name, local, remote, "DRAM", timeout_s=30, dst=out)
    finally:
        reader.close()
    ticket = ray.get(links["mallory"].handle.begin_put.remote(["m/t2"], hints=DRAM), timeout=30)
    try:  # a put's ticket: the one chunk it writes into
        target = ticket.target
        assert target.peer.chunks == ((target.chunk_offset, target.nbytes),)
    finally:
        ray.get(links["mallory"].handle.abort_put.remote(ticket.put_id), timeout=30)


def node_pid(link) -> int:
    """The storage node's process id (what its hand-outs answer with)."""
    from flatcake_ray.media.fd_handout import ChunkReceiver

    with ChunkReceiver() as receiver:  # an empty hand-out, never taken
        return ray.get(link.handle.hand_chunks.remote(receiver.name, "arena", []), timeout=30)[1]


def test_a_process_of_the_same_user_cannot_open_the_nodes_memory(service):
    """The node keeps its memory private (non-dumpable: ``tests/test_fd_handout.py`` shows
    what that closes), and an unprivileged probe opens nothing of it through ``/proc``."""
    link = service["victim"].nodes.links[1]
    assert ray.get(link.handle.stats.remote(), timeout=30)["memory_private"] is True
    assert opened_through_proc(node_pid(link)) == []


def test_a_tenants_ssd_pages_read_by_path_show_none_of_its_bytes(service):
    """Every pool file opened by path (``describe`` names them to every tenant, and a
    process of the service's OS user can open them anyway) holds none of the victim's SSD
    bytes, which the victim's own client restores exactly."""
    victim, mallory = service["victim"], service["mallory"]
    data = marked_kv(16, seed=23)
    keys = [f"sealed/{i}" for i in range(16)]
    victim.put(keys, data, hints=SSD)
    assert victim.probe(keys).on_ssd
    description = ray.get(mallory.nodes.links[1].handle.describe.remote(), timeout=30)
    on_drive = b"".join(Path(path).read_bytes() for path in description.pool_paths)
    assert lines_found(data, on_drive) == 0
    out = np.zeros_like(data)
    report = victim.restore_report(keys, out)
    assert report.pages == 16 and np.array_equal(out, data)
    assert list(report.paths) == [LOCAL_SSD]  # read from the pool files, then unsealed


class Mallory:
    """Garbage into everything the malicious tenant's client can reach, until stopped."""

    def __init__(self, client) -> None:
        link = client.nodes.links[1]
        client.put(["m/d0", "m/d1"], kv(2, 7), hints=DRAM)  # takes an arena chunk of its own
        description = ray.get(link.handle.describe.remote(), timeout=30)
        ticket = link.handle.begin_put.remote(["m/0"], hints=SSD)
        target = ray.get(ticket, timeout=30).target
        assert target.memory is PutMemory.LANDING  # its own put hands out a landing chunk
        handed = link.hand_chunks("arena") + link.hand_chunks("landing", [target.chunk_offset])
        self.maps = []
        for chunk in handed:
            self.maps.append(map_shared(chunk.fd, chunk.nbytes)[1])
            os.close(chunk.fd)
        self.pools = [(path, description.pool_file_bytes) for path in description.pool_paths]
        self.rng = np.random.default_rng(99)
        self.writes = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            garbage = self.rng.integers(0, 256, int(self.rng.integers(1, 64 << 10)), np.uint8)
            choice = int(self.rng.integers(0, len(self.maps) + len(self.pools)))
            if choice < len(self.maps):
                memory = self.maps[choice]
                at = int(self.rng.integers(0, len(memory) - len(garbage)))
                memory[at : at + len(garbage)] = garbage
            else:
                path, nbytes = self.pools[choice - len(self.maps)]
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.pwrite(
                        fd, garbage.tobytes(), int(self.rng.integers(0, nbytes - len(garbage)))
                    )
                finally:
                    os.close(fd)
            self.writes += 1
            time.sleep(0.0005)


def test_a_malicious_tenant_writing_everywhere_delivers_no_wrong_byte(service):
    mallory, client = Mallory(service["mallory"]), service["victim"]
    mallory.thread.start()
    stored: dict[str, np.ndarray] = {}
    tally = {"wrong_bytes": 0, "tampered_puts": 0, "puts": 0, "misses": 0, "hits": 0}
    deadline = time.monotonic() + SOAK_S
    try:
        for round_ in range(ROUNDS):
            if time.monotonic() > deadline:
                break
            for name, pages, hints in ((f"d{round_}", 4, DRAM), (f"s{round_}", 8, SSD)):
                data = kv(pages, round_ * 2 + pages)
                try:
                    client.put([f"{name}/{i}" for i in range(pages)], data, hints=hints)
                    stored[name] = data
                    tally["puts"] += 1
                except TamperedWriteError:
                    tally["tampered_puts"] += 1
            for name in list(stored)[-2 * KEPT :]:
                data = stored[name]
                out = np.zeros_like(data)
                count = client.get([f"{name}/{i}" for i in range(data.shape[1])], out)
                tally["wrong_bytes"] += int((out[:, :count] != data[:, :count]).sum())
                tally["hits" if count == data.shape[1] else "misses"] += 1
    finally:
        mallory.stop.set()
        mallory.thread.join(timeout=30)
    print("malicious soak:", tally, "garbage writes:", mallory.writes)
    assert tally["wrong_bytes"] == 0
    assert mallory.writes > 100 and tally["puts"] > 0
    assert tally["misses"] > 0  # the garbage did land somewhere (the pool files)
