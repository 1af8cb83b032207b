"""The owner's side of the Ray client's puts as a plain class (``actors/node_puts.py``): where a
put's bytes go (arena in place, landing slots, or the call), and that space coming back.

The client's side (mapped files, NIXL WRITE) runs against a real service in test_service.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from flatcake_ray.actors.landing import LandingArea
from flatcake_ray.actors.node_puts import NodePuts
from flatcake_ray.actors.protocol import PutMemory
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.errors import ShapeError, StoreWriteError
from tests.conftest import LAYERS, PAGE_BYTES, random_kv

DRAM = PutHints(turn=2, prior_reply_tokens=1, context_tokens=1)
SSD = PutHints(turn=1)


@pytest.fixture
def owner(make_store):
    """A store and the owner's put side with ``landing`` bytes of landing area."""
    made = []

    def build(landing: int, **config) -> tuple:
        store = make_store(**config)
        area = LandingArea(landing, f"test-landing-{len(made)}-{id(store)}")
        counters = dict.fromkeys(("puts", "puts_layerwise", "puts_aborted", "aborts_refused"), 0)
        counters.update({f"puts_{memory.value}": 0 for memory in PutMemory})
        puts = NodePuts(store, area, counters, (os.getpid(), 0.0))
        made.append(puts)
        return store, puts, counters

    yield build
    for puts in made:
        puts.close()


def restore(store, keys: list[str]) -> tuple[int, np.ndarray]:
    out = np.zeros((LAYERS, len(keys), PAGE_BYTES), dtype=np.uint8)
    return store.get(keys, out), out


def put_keys(name: str, pages: int = 32) -> list[str]:
    return [f"{name}-{i}" for i in range(pages)]


def write(puts: NodePuts, ticket, kv: np.ndarray, layer: int) -> None:
    """What a client on the owner's node does: copy the new pages into the handed-out memory."""
    target = ticket.target
    pages = kv[layer][target.new_positions].reshape(-1)
    memory = puts.store.arena.view if target.memory is PutMemory.ARENA else puts.landing.memory.view
    offset = target.offsets[layer % len(target.offsets)]
    memory[offset : offset + pages.nbytes] = pages


def test_a_dram_put_is_written_in_place_and_landed_at_commit(owner):
    store, puts, counters = owner(1 << 20)
    kv = random_kv(6, seed=1)
    ticket = puts.begin("default", [f"d{i}" for i in range(6)], {"hints": DRAM})
    assert ticket.target.memory is PutMemory.ARENA and len(ticket.target.offsets) == LAYERS
    for layer in range(LAYERS):
        write(puts, ticket, kv, layer)
    result = puts.commit("default", ticket.put_id, list(range(LAYERS)))
    assert result.pages_written == 6 and counters["puts_arena"] == 1
    count, out = restore(store, [f"d{i}" for i in range(6)])
    assert count == 6 and np.array_equal(out, kv)


def test_ssd_slots_shrink_with_the_room_left_then_the_call_carries_the_bytes(owner):
    layer_bytes = 32 * PAGE_BYTES  # a 32-page put: one slot is 256 KiB
    store, puts, counters = owner(5 * layer_bytes)  # room for 2 + 2 + 1 slots
    tickets = [
        puts.begin("default", [f"s{n}-{i}" for i in range(32)], {"hints": SSD}) for n in range(4)
    ]
    memories = [ticket.target.memory for ticket in tickets]
    assert memories == [PutMemory.LANDING] * 3 + [PutMemory.INLINE]
    assert [len(ticket.target.offsets) for ticket in tickets[:3]] == [2, 2, 1]
    kv = random_kv(32, seed=2)
    one_slot, squeezed = tickets[2], tickets[3]
    for layer in range(LAYERS):  # one slot: each layer lands before the next is written
        write(puts, one_slot, kv, layer)
        puts.land("default", one_slot.put_id, layer, None)
        puts.land("default", squeezed.put_id, layer, kv[layer].reshape(-1))
    for ticket in (one_slot, squeezed):
        assert puts.commit("default", ticket.put_id, ()).pages_written == 32
    for n in (2, 3):
        count, out = restore(store, put_keys(f"s{n}"))
        assert count == 32 and np.array_equal(out, kv)
    puts.abort("default", tickets[0].put_id)  # its two slots come back
    again = puts.begin("default", [f"t{i}" for i in range(32)], {"hints": SSD})
    assert again.target.memory is PutMemory.LANDING and len(again.target.offsets) == 2
    assert (counters["puts_landing"], counters["puts_inline"]) == (4, 1)


def test_a_layer_in_the_call_lands_from_read_only_memory_that_happens_to_be_aligned(owner):
    """A call's bytes can lie in Ray's object store (read-only) at a 4 KiB boundary: the
    node writes them through its own staging, never into them (CI caught the write)."""
    store, puts, _ = owner(0)  # no landing room: every layer comes in the call
    keys = put_keys("ro")
    ticket = puts.begin("default", keys, {"hints": SSD})
    assert ticket.target.memory is PutMemory.INLINE
    kv = random_kv(len(keys), seed=3)
    for layer in range(LAYERS):
        pages = kv[layer].reshape(-1)
        backing = np.empty(pages.nbytes + 4096, dtype=np.uint8)
        lead = -backing.ctypes.data % 4096
        inline = backing[lead : lead + pages.nbytes]
        inline[:] = pages
        inline.flags.writeable = False
        puts.land("default", ticket.put_id, layer, inline)
        assert np.array_equal(inline, pages)
    assert puts.commit("default", ticket.put_id, ()).pages_written == len(keys)
    count, out = restore(store, keys)
    assert count == len(keys) and np.array_equal(out, kv)


def test_bad_calls_are_refused_and_ended_puts_free_their_slots(owner):
    _, puts, counters = owner(8 * 32 * PAGE_BYTES)
    keys = [f"b{i}" for i in range(32)]
    ticket = puts.begin("default", keys, {"hints": SSD})
    with pytest.raises(ShapeError):  # a malformed call is refused and changes nothing
        puts.land("default", ticket.put_id, "0", None)
    puts.abort("default", ticket.put_id)  # still open, so its writer can abort it
    with pytest.raises(StoreWriteError):  # and then it is gone
        puts.land("default", ticket.put_id, 0, None)
    ticket = puts.begin("default", keys, {"hints": SSD})
    with pytest.raises(StoreWriteError, match="before layers"):
        puts.commit("default", ticket.put_id, [0])
    with pytest.raises(StoreWriteError):  # another tenant cannot name it, nor can anyone now
        puts.abort("other", ticket.put_id)
    assert counters["aborts_refused"] == 1
    assert counters["puts_aborted"] == 2  # every slot is free again: four two-slot puts fit
    tickets = [
        puts.begin("default", [f"c{n}-{i}" for i in range(32)], {"hints": SSD}) for n in range(4)
    ]
    assert all(len(t.target.offsets) == 2 for t in tickets)
