"""A writer of an owner's shared memory cannot plant bytes in another's put or pages.

Clients write puts in place (DRAM arena, SSD landing slots) and send the block checksums of
what they wrote (``core/integrity.py`` ``block_checksums``); the owner refuses other bytes
(:class:`TamperedWriteError`: nothing published, space back) and keeps the writer's
checksums, and readers check DRAM too (``verify_dram``, on by default) on memory no one
else writes: where the pages land in the reader's own memory, or a private copy of what they
map: a write there after the commit is a miss, never bytes."""

from __future__ import annotations

import numpy as np
import pytest

from flatcake_ray.actors.protocol import PutMemory
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.integrity import block_checksums
from flatcake_ray.cuda_ext import host_hash
from flatcake_ray.errors import TamperedWriteError
from tests.conftest import LAYERS, PAGE_BYTES, random_kv
from tests.test_node_puts import DRAM, SSD, owner, restore, write  # noqa: F401  (fixture)

GARBAGE = 0xA5


def sums_of(ticket, kv: np.ndarray, layer: int) -> np.ndarray:
    pages = kv[layer][ticket.target.new_positions].reshape(-1)
    return block_checksums(pages, ticket.target.check_pages * PAGE_BYTES)


def scribble(memory: np.ndarray, ticket, layer: int, nbytes: int = 100) -> None:
    """Another writer of the same memory, in this put's layer ``layer``."""
    at = ticket.target.offsets[layer % len(ticket.target.offsets)] + PAGE_BYTES // 2
    memory[at : at + nbytes] = GARBAGE


def keys(name: str, pages: int) -> list[str]:
    return [f"{name}{i}" for i in range(pages)]


def test_a_dram_put_whose_memory_another_wrote_is_refused_and_publishes_nothing(owner):  # noqa: F811
    """Where readers do not check DRAM (``verify_dram`` off), the owner checks what landed."""
    store, puts, counters = owner(1 << 20)
    kv = random_kv(6, seed=4)
    ticket = puts.begin("default", keys("t", 6), {"hints": DRAM})
    assert ticket.target.memory is PutMemory.ARENA
    for layer in range(LAYERS):
        write(puts, ticket, kv, layer)
    scribble(store.arena.view, ticket, 1)
    with pytest.raises(TamperedWriteError, match="layer 1"):
        puts.commit(
            "default",
            ticket.put_id,
            list(range(LAYERS)),
            [sums_of(ticket, kv, n) for n in range(LAYERS)],
        )
    assert store.exists(keys("t", 6)) == 0 and counters["puts_aborted"] == 1
    again = puts.begin("default", keys("t", 6), {"hints": DRAM})  # the space came back
    for layer in range(LAYERS):
        write(puts, again, kv, layer)
    sums = [sums_of(again, kv, n) for n in range(LAYERS)]
    assert puts.commit("default", again.put_id, list(range(LAYERS)), sums).pages_written == 6
    count, out = restore(store, keys("t", 6))
    assert count == 6 and np.array_equal(out, kv)


def test_an_ssd_slot_another_wrote_is_refused_before_it_reaches_the_drive(owner):  # noqa: F811
    store, puts, _ = owner(8 * 32 * PAGE_BYTES)
    kv = random_kv(32, seed=5)
    ticket = puts.begin("default", keys("s", 32), {"hints": SSD})
    assert ticket.target.memory is PutMemory.LANDING
    write(puts, ticket, kv, 0)
    scribble(puts.landing.memory.view, ticket, 0)
    with pytest.raises(TamperedWriteError):
        puts.land("default", ticket.put_id, 0, None, sums_of(ticket, kv, 0))
    assert store.exists(keys("s", 32)) == 0


@pytest.mark.parametrize("medium", ["DRAM", "SSD"])
def test_where_readers_check_a_put_another_wrote_is_kept_as_its_writer_wrote_it(owner, medium):  # noqa: F811
    """With ``verify_dram`` (a service's default) every reader checks every block, so the
    owner keeps the writer's checksums without hashing what landed: the put commits, and the
    bytes another wrote there are a miss for every reader, never data."""
    pages = 6 if medium == "DRAM" else 32
    store, puts, _ = owner(8 * 32 * PAGE_BYTES, verify_dram=True)
    kv = random_kv(pages, seed=12)
    ticket = puts.begin("default", keys("v", pages), {"hints": DRAM if medium == "DRAM" else SSD})
    sums = [sums_of(ticket, kv, n) for n in range(LAYERS)]
    for layer in range(LAYERS):
        write(puts, ticket, kv, layer)
        if medium == "SSD":
            if layer == 1:
                scribble(puts.landing.memory.view, ticket, layer)
            puts.land("default", ticket.put_id, layer, None, sums[layer])
    if medium == "DRAM":
        scribble(store.arena.view, ticket, 1)
        assert puts.commit("default", ticket.put_id, list(range(LAYERS)), sums).pages_written
    else:
        assert puts.commit("default", ticket.put_id, [], []).pages_written
    assert store.exists(keys("v", pages)) == pages
    count, out = restore(store, keys("v", pages))
    assert count < pages
    for layer in range(LAYERS):
        for page in range(pages):
            got = out[layer, page]
            assert not got.any() or np.array_equal(got, kv[layer, page]), (layer, page)


@pytest.fixture(params=["fused", "copy-then-hash"])
def check_pass(request, monkeypatch) -> str:
    """The reader's check as one native pass (a block hashed right after its copy,
    ``cuda_ext/_copyhash.c``) and as the copy, then the hash, where that is not built."""
    if request.param == "fused" and not host_hash.fused():
        pytest.skip(
            "no fused copy: cuda_ext/_copyhash.c not built "
            "(FLATCAKE_NATIVE=0, no compiler) or no libxxhash"
        )
    if request.param == "copy-then-hash":
        monkeypatch.setattr(host_hash, "_native", lambda: None)
    return request.param


@pytest.mark.parametrize("verify", [True, False])
def test_pages_overwritten_after_their_commit_are_a_miss_never_bytes(
    make_store, verify, check_pass
):
    """With ``verify_dram`` (the default) an overwrite of committed DRAM pages is a miss;
    without it the reader gets the other writer's bytes: the check is what protects."""
    store = make_store(verify_dram=verify)
    kv = random_kv(6, seed=6)
    store.put(keys("c", 6), kv, hints=DRAM)
    lease = store.lease(keys("c", 6))
    segment = next(iter(lease.segments.values()))
    assert lease.hits == 6 and segment.medium is Medium.DRAM
    offset = segment.offset  # its first layer's first page, in the arena
    store.release(lease)
    store.arena.view[offset + 10 : offset + 20] = GARBAGE
    count, out = restore(store, keys("c", 6))
    if verify:
        assert count == 0 and not out.any()
    else:
        assert count == 6 and not np.array_equal(out, kv)  # the wrong bytes, as a hit


def test_a_services_nodes_check_dram_reads_unless_told_not_to():
    from flatcake_ray.config import ServiceConfig, StoreConfig

    assert ServiceConfig().store_config("a" * 16, 1, {}).verify_dram is True
    assert (
        ServiceConfig().store_config("a" * 16, 1, {"FLATCAKE_VERIFY_DRAM": "0"}).verify_dram
        is False
    )
    assert StoreConfig(root="/tmp/x", layers=1, page_bytes=4096).verify_dram is False  # one writer


@pytest.mark.parametrize("slots", ["consecutive", "reversed"])
def test_a_checked_restore_of_part_of_a_block_delivers_it_and_a_changed_page_is_a_miss(
    make_store, slots, check_pass
):
    """Readers check DRAM where it lands: into consecutive slots the pages are copied straight
    from the arena and checked there (the block's pages the restore does not take are hashed
    in the arena), into scattered slots on a private copy first. Both deliver the same bytes,
    and a page changed after its commit is a miss: from its layer on, its scope's slots get no
    byte (the layers before it were checked whole and delivered as they are)."""
    store = make_store(verify_dram=True, check_bytes=4 * PAGE_BYTES)
    kv = random_kv(8, seed=9)
    store.put(keys("p", 8), kv, hints=DRAM)
    wanted = keys("p", 6)  # the first block of 4 pages whole, the second one half
    ids = np.arange(6) if slots == "consecutive" else np.arange(6)[::-1].copy()
    out = np.zeros((LAYERS, 6, PAGE_BYTES), dtype=np.uint8)
    assert store.restore(wanted, out, ids).wait() == 6
    assert np.array_equal(out[:, ids], kv[:, :6])

    lease = store.lease(wanted)
    segment = next(iter(lease.segments.values()))
    store.release(lease)
    layout_page = segment.offset + 1 * 8 * PAGE_BYTES + 5 * PAGE_BYTES  # layer 1, page 5
    store.arena.view[layout_page + 7] ^= 0xFF
    out.fill(0)
    assert store.restore(wanted, out, ids).wait() == 0
    assert not out[1:].any()


@pytest.mark.parametrize("changed_page", [1, 3, 6])
def test_a_block_cut_between_two_staging_windows_is_checked_whole(
    make_store, check_pass, changed_page
):
    """Blocks of 4 pages restored through windows of 3: runs are cut at a block's end when
    they can be, so a block is copied and checked by one window, and the block a window does
    cut (a window smaller than a block) is still checked whole: a changed page anywhere in it
    makes the scope a miss, and no wrong byte reaches the destination (blocks checked and
    delivered before the bad one was met keep their right bytes)."""
    store = make_store(
        verify_dram=True, check_bytes=4 * PAGE_BYTES, restore_slot_bytes=3 * PAGE_BYTES + 4096
    )
    kv = random_kv(8, seed=4)
    store.put(keys("w", 8), kv, hints=DRAM)
    out = np.zeros((LAYERS, 8, PAGE_BYTES), dtype=np.uint8)
    assert store.restore(keys("w", 8), out, np.arange(8)).wait() == 8
    assert np.array_equal(out, kv)

    lease = store.lease(keys("w", 8))
    segment = next(iter(lease.segments.values()))
    store.release(lease)
    store.arena.view[segment.offset + changed_page * PAGE_BYTES + 11] ^= 0xFF  # layer 0
    out.fill(0)
    assert store.restore(keys("w", 8), out, np.arange(8)).wait() == 0
    for layer in range(LAYERS):
        for page in range(8):
            got = out[layer, page]
            assert not got.any() or np.array_equal(got, kv[layer, page]), (layer, page)
    assert not out[0, changed_page].any()


def test_a_block_changed_on_the_drive_is_a_miss_and_no_wrong_byte_lands(make_store, check_pass):
    """SSD pages read into a staging slot are copied into consecutive slots and checked
    there (one pass where the native copy is built): an intact session arrives whole, and a
    byte flipped on the drive makes its scope a miss with no wrong byte in the destination."""
    store = make_store(check_bytes=4 * PAGE_BYTES)
    kv = random_kv(8, seed=13)
    store.put(keys("d", 8), kv)
    lease = store.lease(keys("d", 8))
    assert next(iter(lease.segments.values())).medium is Medium.SSD
    store.release(lease)
    count, out = restore(store, keys("d", 8))
    assert count == 8 and np.array_equal(out, kv)

    gva = int(store.gvas(keys("d", 8)[5:6])[0]) & ((1 << 48) - 1)  # layer 0, page 5
    file_index, offset = store.pool.locate(gva)
    with open(store.pool.paths[file_index], "r+b") as pool_file:
        pool_file.seek(offset + 100)
        byte = pool_file.read(1)
        pool_file.seek(offset + 100)
        pool_file.write(bytes([byte[0] ^ 0xFF]))
    count, out = restore(store, keys("d", 8))
    assert count == 0
    for layer in range(LAYERS):
        for page in range(8):
            got = out[layer, page]
            assert not got.any() or np.array_equal(got, kv[layer, page]), (layer, page)
    assert not out[0, 5].any()
