"""A chunk that changes tenants gets a fresh file (issue 23, "a chunk's former owner"): a
process that mapped it for the tenant that held it before reads nothing the next tenant
writes there and writes nothing the next tenant reads, the old file's memory goes back at
once, and a client of a tenant that gets a chunk back maps it anew before it reads or
writes there. Through the store, its arena, its landing area and the clients' mappings."""

from __future__ import annotations

import mmap
import os
from types import SimpleNamespace

import numpy as np
import pytest

from flatcake_ray.actors.landing import LandingArea
from flatcake_ray.actors.protocol import PutMemory, PutTarget
from flatcake_ray.client.put_targets import PutTargets
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.tenants import Tenant, new_secret, secret_hash
from flatcake_ray.media.chunk_files import is_retired
from flatcake_ray.media.fd_handout import HandedChunk
from flatcake_ray.transports.base import ReadBatch
from flatcake_ray.transports.local_dram import LocalDramTransport
from tests.conftest import LAYERS, PAGE_BYTES, random_kv

DRAM = PutHints(turn=2, prior_reply_tokens=1)
CHUNK = 256 << 10


@pytest.fixture
def store(make_store):
    made = make_store(dram_bytes=2 * CHUNK, dram_chunks=2)
    for name in ("alpha", "beta"):
        made.set_tenant(Tenant(name, secret_hash(new_secret()), LAYERS, PAGE_BYTES))
    return made


def put(store, name: str, session: int, pages: int = 4) -> list[str]:
    keys = [f"{name}-{session}-{i}" for i in range(pages)]
    store.put(keys, random_kv(pages, seed=session), tenant=name, hints=DRAM, session_id=session)
    return keys


def take_every_chunk(store, name: str, first_session: int) -> list[str]:
    """Put sessions of ``name`` until it holds both chunks; returns every key it put."""
    keys: list[str] = []
    for session in range(first_session, first_session + 8):
        if len(store.arena_chunks(name)) == store.arena.chunks:
            return keys
        keys += put(store, name, session)
    raise AssertionError(f"{name} never held every chunk")


def handed(store, offset: int) -> HandedChunk:
    """The chunk at ``offset`` as a client gets it: a descriptor of its own."""
    return HandedChunk(offset, CHUNK, os.dup(store.arena.chunk_fd(offset)))


def pages_in(store, name: str, keys: list[str], offset: int) -> list[int]:
    """Arena offsets of ``name``'s pages (first layer) that lie in the chunk at ``offset``."""
    gvas = [int(g) for g in store.gvas(keys, tenant=name)]
    return [g for g in gvas if offset <= g < offset + CHUNK]


def test_a_former_tenants_mapping_reaches_nothing_the_next_tenant_writes(store):
    put(store, "alpha", 1)
    (chunk,) = store.arena_chunks("alpha")
    kept = handed(store, chunk.offset)  # what alpha's client (or a malicious one) keeps
    mapping = mmap.mmap(kept.fd, CHUNK, flags=mmap.MAP_SHARED)
    former = np.frombuffer(mapping, dtype=np.uint8)
    assert store.stats()["chunks_renewed"] == 0
    store.remove_tenant("alpha")  # its chunk empties and is free
    beta_keys = take_every_chunk(store, "beta", 10)
    assert store.stats()["chunks_renewed"] == 1  # the chunk alpha held; not the fresh one
    assert is_retired(kept.fd) and not is_retired(store.arena.chunk_fd(chunk.offset))
    assert os.fstat(kept.fd).st_blocks == 0  # the old file's memory went back at once
    at = pages_in(store, "beta", beta_keys, chunk.offset)
    assert at, "beta took the chunk alpha held"
    for gva in at:
        local = gva - chunk.offset
        assert store.arena.view[gva : gva + PAGE_BYTES].any()  # beta's page is there...
        assert not former[local : local + PAGE_BYTES].any()  # ...and not in alpha's mapping
        former[local : local + PAGE_BYTES] = 0xAB  # nor do alpha's writes reach beta's page
    out = np.zeros((LAYERS, len(beta_keys), PAGE_BYTES), dtype=np.uint8)
    assert store.get(beta_keys, out, tenant="beta") == len(beta_keys)  # unchecked DRAM...
    assert np.array_equal(out, reference(beta_keys))  # ...and every byte beta's own
    del former
    mapping.close()
    os.close(kept.fd)


def test_a_tenant_added_again_under_its_name_gets_fresh_files(store):
    """Removing a tenant and adding it again is how its secret is rotated: the clients of
    the one removed (a leaked secret's) must reach nothing the new one writes."""
    put(store, "alpha", 1)
    (chunk,) = store.arena_chunks("alpha")
    kept = handed(store, chunk.offset)
    store.remove_tenant("alpha")
    store.set_tenant(Tenant("alpha", secret_hash(new_secret()), LAYERS, PAGE_BYTES))
    keys = take_every_chunk(store, "alpha", 10)  # the same name takes the chunk back
    assert is_retired(kept.fd) and pages_in(store, "alpha", keys, chunk.offset)
    os.close(kept.fd)
    area = LandingArea(2 * CHUNK, f"again-{os.getpid()}", chunks=2)
    try:
        first = [area.take(CHUNK, "alpha") for _ in range(2)]
        kept = [os.dup(area.memory.chunk_fd(c.offset)) for c in area.chunks_of("alpha")]
        for slot_id, _ in first:
            area.give(slot_id, "alpha")
        area.forget("alpha")  # removed from the service
        for _ in range(2):
            area.take(CHUNK, "alpha")  # added again: both chunks fresh
        assert all(is_retired(fd) for fd in kept)
    finally:
        for fd in kept:
            os.close(fd)
        area.close()


def reference(keys: list[str]) -> np.ndarray:
    """The pages :func:`put` wrote for ``keys`` (sessions of four pages, seeded by session)."""
    sessions = {int(key.split("-")[1]) for key in keys}
    return np.concatenate([random_kv(4, seed=s) for s in sorted(sessions)], axis=1)


def test_a_reader_maps_a_chunk_its_tenant_got_back_anew(store):
    alpha_keys = put(store, "alpha", 1)
    reader = LocalDramTransport.attach(
        lambda: [handed(store, c.offset) for c in store.arena_chunks("alpha")],
        store.arena.nbytes,
    )
    try:
        assert read_pages(store, reader, "alpha", alpha_keys)  # mapped as handed
        store.remove_tenant("alpha")
        put(store, "beta", 10)
        take_every_chunk(store, "beta", 11)  # beta held both chunks...
        store.remove_tenant("beta")  # ...and now neither
        store.set_tenant(Tenant("alpha", secret_hash(new_secret()), LAYERS, PAGE_BYTES))
        again = take_every_chunk(store, "alpha", 20)  # alpha holds both, each a fresh file
        assert store.stats()["chunks_renewed"] >= 3
        # The chunk the reader mapped before is among them: it is read from its new file.
        assert read_pages(store, reader, "alpha", again)
    finally:
        reader.close()


def read_pages(store, reader, name: str, keys: list[str]) -> bool:
    """Whether the reader reads every page of ``keys`` (first layer) as the arena holds it."""
    gvas = np.array([int(g) for g in store.gvas(keys, tenant=name)], dtype=np.int64)
    lengths = np.full(len(gvas), PAGE_BYTES, dtype=np.int64)
    out = np.zeros(len(gvas) * PAGE_BYTES, dtype=np.uint8)
    reader.read(ReadBatch(gvas, lengths, np.arange(len(gvas)) * PAGE_BYTES), out)
    expected = np.concatenate([store.arena.view[g : g + PAGE_BYTES] for g in gvas])
    return bool(np.array_equal(out, expected)) and bool(expected.any())


class _Link:
    """What ``PutTargets`` asks of a node's link: its name, and its tenant's chunks."""

    def __init__(self, area: LandingArea, owner: str) -> None:
        self.description = SimpleNamespace(actor_name="node")
        self.area, self.owner = area, owner

    def hand_chunks(self, memory: str, offsets: list[int]) -> list[HandedChunk]:
        assert memory == "landing"
        held = {c.offset: c for c in self.area.chunks_of(self.owner)}
        fds = [os.dup(self.area.memory.chunk_fd(offset)) for offset in offsets]
        return [HandedChunk(o, held[o].nbytes, fd) for o, fd in zip(offsets, fds, strict=True)]


def landing_target(offset: int) -> PutTarget:
    """A put's ticket naming one slot in the landing chunk at ``offset``."""
    return PutTarget(PutMemory.LANDING, (offset,), CHUNK, np.arange(1), chunk_offset=offset)


def test_a_landing_chunk_changes_tenants_and_a_put_writer_maps_it_anew():
    area = LandingArea(2 * CHUNK, f"handover-{os.getpid()}", chunks=2)
    targets = PutTargets(staging=None, timeout_s=5.0)
    try:
        slot, at = area.take(CHUNK, "alpha")
        chunk = area.chunk_at(at)
        alpha = _Link(area, "alpha")
        written = targets.mapped(alpha, landing_target(chunk.offset))
        written[:16] = 7  # alpha's client writes its slot
        assert (area.view(at, 16) == 7).all()
        area.give(slot, "alpha")
        taken = [area.take(CHUNK, "beta") for _ in range(2)]  # both: one alpha held, renewed
        ((_, beta_at),) = [(s, a) for s, a in taken if area.chunk_at(a) == chunk]
        area.view(beta_at, 16)[:] = 9  # beta's bytes land
        assert not written[:16].any() and (area.view(beta_at, 16) == 9).all()
        written[:16] = 5  # alpha's old mapping writes nothing beta's slot holds
        assert (area.view(beta_at, 16) == 9).all()
        for slot_id, _ in taken:
            area.give(slot_id, "beta")
        again_at = [area.take(CHUNK, "alpha")[1] for _ in range(2)]  # both, fresh files again
        assert chunk.offset in again_at
        again = targets.mapped(alpha, landing_target(chunk.offset))
        again[:16] = 3  # mapped anew: what alpha writes now is what the node sees
        assert (area.view(chunk.offset, 16) == 3).all()
    finally:
        targets.close()
        area.close()


def test_a_vacated_chunk_is_renewed_off_the_lock_and_the_next_tenant_pays_nothing(store):
    """What a storage node does before each report: a chunk alpha left empty gets its fresh
    file while the store keeps answering (the store's lock is not held), then beta takes it
    with no renewal in its put."""
    import threading

    put(store, "alpha", 1)
    (chunk,) = store.arena_chunks("alpha")
    kept = handed(store, chunk.offset)
    store.remove_tenant("alpha")
    started, go_on = threading.Event(), threading.Event()
    renew = store.arena.renew_chunk

    def slow_renew(index: int) -> None:
        started.set()
        assert go_on.wait(30)
        renew(index)

    store.arena.renew_chunk = slow_renew  # type: ignore[method-assign]
    renewer = threading.Thread(target=store.hand_over_vacated)
    renewer.start()
    try:
        assert started.wait(30)
        assert store.exists(["anything"], tenant="beta") == 0  # answered: the lock is free
        assert store.arena_chunks("beta") == ()
        put(store, "beta", 5)  # not into the chunk being renewed
        assert chunk.offset not in {c.offset for c in store.arena_chunks("beta")}
    finally:
        go_on.set()
        renewer.join(30)
        store.arena.renew_chunk = renew  # type: ignore[method-assign]
    assert is_retired(kept.fd) and store.stats()["chunks_renewed"] == 1
    take_every_chunk(store, "beta", 10)
    assert chunk.offset in {c.offset for c in store.arena_chunks("beta")}
    assert store.stats()["chunks_renewed"] == 1  # beta's put renewed nothing
    os.close(kept.fd)
