"""A node's arena in chunks (memfds, no path), each holding one tenant's pages at a time
(issue 23): the store hands a tenant its own chunks only, a tenant grows into a free chunk
and gives an emptied one back, and a reader can map and read only the chunks it was handed."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from flatcake_ray.client.put_targets import map_shared
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.tenants import Tenant, new_secret, secret_hash
from flatcake_ray.errors import ForeignMemoryError
from flatcake_ray.media.chunk_map import ChunkMap
from flatcake_ray.media.fd_handout import HandedChunk
from flatcake_ray.transports.base import ReadBatch
from flatcake_ray.transports.local_dram import LocalDramTransport
from tests.conftest import LAYERS, PAGE_BYTES, random_kv

DRAM = PutHints(turn=2, prior_reply_tokens=1)
CHUNK = 256 << 10


def tenant(name: str) -> Tenant:
    return Tenant(name, secret_hash(new_secret()), LAYERS, PAGE_BYTES)


@pytest.fixture
def store(make_store):
    made = make_store(dram_bytes=4 * CHUNK, dram_chunks=4)
    for name in ("alpha", "beta"):
        made.set_tenant(tenant(name))
    return made


def put(store, name: str, session: int, pages: int = 2) -> list[str]:
    keys = [f"{name}-{session}-{i}" for i in range(pages)]
    store.put(keys, random_kv(pages, seed=session), tenant=name, hints=DRAM, session_id=session)
    return keys


def test_each_tenant_is_handed_its_own_chunks_only(store):
    assert store.arena_chunks("alpha") == ()  # nothing held: nothing handed
    put(store, "alpha", 1)
    put(store, "beta", 2)
    alpha, beta = store.arena_chunks("alpha"), store.arena_chunks("beta")
    assert len(alpha) == len(beta) == 1 and alpha[0].offset != beta[0].offset
    assert store.arena.chunks == len(set(store.arena.chunk_fds)) == 4  # a memfd per chunk
    for chunk in (*alpha, *beta):
        fd = store.arena.chunk_fd(chunk.offset)
        # No path reaches it: a memfd's name is a label, not a file anyone can open.
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:flatcake-")
        assert os.fstat(fd).st_size == chunk.nbytes == CHUNK
    gva = int(store.gvas(["alpha-1-0"], tenant="alpha")[0])
    assert alpha[0].offset <= gva < alpha[0].offset + alpha[0].nbytes  # its pages are in it


def grow(store, name: str, chunks: int, first_session: int) -> None:
    """Put sessions of ``name`` until it holds ``chunks`` chunks (at most eight sessions)."""
    for session in range(first_session, first_session + 8):
        if len(store.arena_chunks(name)) >= chunks:
            return
        put(store, name, session, pages=4)
    assert len(store.arena_chunks(name)) >= chunks


def test_a_tenant_grows_into_a_free_chunk_and_gives_an_emptied_one_back(store):
    first = put(store, "alpha", 0, pages=4)
    where = store.gvas(first, tenant="alpha")
    grow(store, "alpha", 2, 1)
    held = store.arena_chunks("alpha")
    assert len(held) == 2  # grown by a chunk; its first pages stayed where they were
    assert np.array_equal(store.gvas(first, tenant="alpha"), where)
    put(store, "beta", 20, pages=4)
    assert not set(held) & set(store.arena_chunks("beta"))
    store.remove_tenant("alpha")  # its chunks empty: they belong to no one again
    assert store.arena_chunks("alpha") == ()
    grow(store, "beta", 3, 21)  # beyond the two chunks alpha never held: one it gave back
    assert set(held) & set(store.arena_chunks("beta"))


def test_a_reader_reads_its_chunks_and_nothing_else(store):
    keys = put(store, "alpha", 1)
    put(store, "beta", 2)
    mine, theirs = store.arena_chunks("alpha")[0], store.arena_chunks("beta")[0]
    reader = LocalDramTransport.attach(lambda: [handed(store, mine)], store.arena.nbytes)
    try:
        gva = int(store.gvas(keys[:1], tenant="alpha")[0])
        out = np.zeros(PAGE_BYTES, dtype=np.uint8)
        reader.read(ReadBatch([gva], [PAGE_BYTES], [0]), out)
        assert np.array_equal(out, store.arena.view[gva : gva + PAGE_BYTES])
        for start, length in ((theirs.offset, 64), (mine.offset + mine.nbytes - 8, 64)):
            with pytest.raises(ForeignMemoryError):  # another's chunk; past the end of mine
                reader.read(ReadBatch([start], [length], [0]), np.zeros(64, np.uint8))
    finally:
        reader.close()


def handed(store, chunk) -> HandedChunk:
    """``chunk`` as a client gets it: a descriptor of its own (the reader closes it)."""
    return HandedChunk(chunk.offset, chunk.nbytes, os.dup(store.arena.chunk_fd(chunk.offset)))


def test_a_chunk_learned_from_a_put_is_read_without_asking_again(store):
    """A client that put into a chunk its reader did not map yet (the tenant grew) tells the
    reader, which then reads there without asking the node; a chunk renewed since (another
    tenant's now) is learned afresh, and the former mapping never read again."""
    put(store, "alpha", 0, pages=4)
    asked: list[int] = []

    def hand() -> list[HandedChunk]:
        asked.append(1)
        return [handed(store, chunk) for chunk in store.arena_chunks("alpha")]

    reader = LocalDramTransport.attach(hand, store.arena.nbytes)
    try:
        grow(store, "alpha", 2, 1)
        newest = max(store.arena_chunks("alpha"), key=lambda chunk: chunk.offset)
        reader.learn([handed(store, newest)])
        keys = [f"alpha-{s}-0" for s in range(8) if store.exists([f"alpha-{s}-0"], tenant="alpha")]
        gvas = [int(g) for g in store.gvas(keys, tenant="alpha")]
        inside = [g for g in gvas if newest.offset <= g < newest.offset + newest.nbytes]
        assert inside  # pages of the chunk it grew into
        out = np.zeros(PAGE_BYTES, dtype=np.uint8)
        reader.read(ReadBatch([inside[0]], [PAGE_BYTES], [0]), out)
        assert np.array_equal(out, store.arena.view[inside[0] : inside[0] + PAGE_BYTES])
        assert len(asked) == 1  # the attach only
        store.remove_tenant("alpha")
        store.hand_over_vacated()  # its chunks get fresh files: the old ones are retired
        grow(store, "beta", 4, 30)
        assert newest in store.arena_chunks("beta")
        reader.learn([handed(store, newest)])  # as beta's client would: the fresh file
        keys = [
            f"beta-{s}-0" for s in range(30, 38) if store.exists([f"beta-{s}-0"], tenant="beta")
        ]
        at = next(
            int(g)
            for g in store.gvas(keys, tenant="beta")
            if newest.offset <= int(g) < newest.offset + newest.nbytes
        )
        reader.read(ReadBatch([at], [PAGE_BYTES], [0]), out)
        assert np.array_equal(out, store.arena.view[at : at + PAGE_BYTES])
    finally:
        reader.close()


def test_a_chunk_cannot_be_mapped_or_written_past_its_end(store):
    put(store, "alpha", 1)
    mine = handed(store, store.arena_chunks("alpha")[0])
    try:
        with pytest.raises(ValueError, match="mmap length is greater than file size"):
            map_shared(mine.fd, mine.nbytes + mmap.PAGESIZE)
        mapping, view = map_shared(mine.fd, mine.nbytes)
    finally:
        os.close(mine.fd)
    with pytest.raises(ValueError):
        view[mine.nbytes - 8 : mine.nbytes + 8] = np.ones(16, np.uint8)  # 8 bytes past it
    del view
    mapping.close()


def test_landing_slots_come_from_a_chunk_their_tenant_holds():
    from flatcake_ray.actors.landing import LandingArea

    area = LandingArea(4 * CHUNK, f"landing-test-{CHUNK}", chunks=4)
    try:
        alpha_id, alpha_at = area.take(CHUNK // 2, "alpha")
        beta_id, beta_at = area.take(CHUNK // 2, "beta")
        alpha, beta = area.chunk_at(alpha_at), area.chunk_at(beta_at)
        assert alpha.offset != beta.offset and alpha.nbytes == CHUNK
        assert area.chunks_of("alpha") == (alpha,) and area.chunks_of("beta") == (beta,)
        assert area.chunk_at(area.take(CHUNK // 4, "alpha")[1]) == alpha  # fills its own first
        area.give(alpha_id, "beta")  # not beta's: nothing changes
        assert area.take(CHUNK, "beta") is not None  # a free chunk, not alpha's half-empty one
        assert area.take(CHUNK, "gamma") is not None and area.take(CHUNK // 2, "delta") is None
        area.give(beta_id, "beta")  # beta's first chunk empties: free for anyone again
        assert area.chunk_at(area.take(CHUNK, "delta")[1]) == beta
    finally:
        area.close()


def _free_huge_pages() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("HugePages_Free:"):
            return int(line.split()[1])
    return 0


HUGE = 2 << 20


def test_chunk_maps_reserve_room_a_hugetlb_file_can_map_into():
    # A hugetlb file maps only at a 2 MiB boundary, its length rounded up to whole pages: a
    # reader's map (which does not know the kind of the chunks it will be handed) is laid out
    # so, whatever its size.
    for nbytes in (HUGE - 4096, 3 * HUGE + 4096, 5 * CHUNK):
        chunk_map = ChunkMap(nbytes)
        assert chunk_map.base % HUGE == 0 and chunk_map.view.nbytes == nbytes


@pytest.mark.skipif(
    _free_huge_pages() < 8,
    reason="no 2 MiB huge pages reserved here (sysctl vm.nr_hugepages; `ray up` reserves them)",
)
def test_hugetlb_chunks_are_read_and_landed_into_by_other_processes(make_store):
    from flatcake_ray.actors.landing import LandingArea

    store = make_store(dram_bytes=2 * HUGE, dram_chunks=2, hugepages="require")
    store.set_tenant(tenant("alpha"))
    keys = put(store, "alpha", 1)
    mine = store.arena_chunks("alpha")[0]
    assert store.arena.huge and mine.nbytes == HUGE
    reader = LocalDramTransport.attach(lambda: [handed(store, mine)], store.arena.nbytes)
    area = LandingArea(2 * HUGE, f"landing-huge-{os.getpid()}", chunks=2, hugepages=True)
    try:
        gva = int(store.gvas(keys[:1], tenant="alpha")[0])
        out = np.zeros(PAGE_BYTES, dtype=np.uint8)
        reader.read(ReadBatch([gva], [PAGE_BYTES], [0]), out)
        assert np.array_equal(out, store.arena.view[gva : gva + PAGE_BYTES])
        assert area.memory.huge
        _, at = area.take(HUGE // 2, "alpha")
        chunk = area.chunk_at(at)
        mapping, view = map_shared(area.memory.chunk_fd(chunk.offset), chunk.nbytes)
        view[at - chunk.offset : at - chunk.offset + 8] = 7  # a client writes its slot
        assert (area.view(at, 8) == 7).all()
        del view
        mapping.close()
    finally:
        reader.close()
        area.close()


def _smaps_of(address: int) -> dict[str, str]:
    """This process's ``/proc/self/smaps`` entry for the mapping holding ``address``."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end ..."
            start, end = (int(edge, 16) for edge in head.split("-"))
            entry = {} if start <= address < end else None
        elif entry is not None:
            name, _, value = line.partition(":")
            entry[name] = value.strip()
            if name == "VmFlags":
                return entry
    raise AssertionError(f"no mapping holds {address:#x}")


def _shmem_huge_setting() -> str:
    setting = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    if not setting.exists():  # a kernel built without transparent huge pages
        return "never"
    return next(word.strip("[]") for word in setting.read_text().split() if word[0] == "[")


@pytest.fixture
def thp_arena():
    from flatcake_ray.media.arena import DramArena

    arena = DramArena(2 * HUGE, f"thp-{os.getpid()}", hugepages="off", chunk_bytes=HUGE)
    yield arena
    arena.close()


def test_chunk_mappings_ask_for_huge_pages_the_owner_s_and_a_reader_s(thp_arena):
    # Asked before any page is faulted in: only then can an administrator's `advise` make
    # them 2 MiB (the owner's pages are what a peer's cross-memory READ pins).
    assert "hg" in _smaps_of(thp_arena.view.ctypes.data)["VmFlags"].split()
    reader = ChunkMap(2 * HUGE)
    fd = os.dup(thp_arena.chunk_fd(HUGE))
    try:
        reader.place(HUGE, fd, HUGE, shared=False)
        assert "hg" in _smaps_of(reader.base + HUGE)["VmFlags"].split()
        assert (reader.view[HUGE : 2 * HUGE] == 0).all()
    finally:
        reader.unplace(HUGE)
        os.close(fd)


@pytest.mark.skipif(
    _shmem_huge_setting() in ("never", "deny"),
    reason="shared memory gets no transparent huge pages here "
    f"(/sys/kernel/mm/transparent_hugepage/shmem_enabled is {_shmem_huge_setting()})",
)
def test_an_arena_s_pages_are_huge_where_shared_memory_may_have_them(thp_arena):
    thp_arena.view[:] = 7
    mapped_kb = int(_smaps_of(thp_arena.view.ctypes.data)["ShmemPmdMapped"].split()[0])
    assert mapped_kb >= HUGE >> 10
