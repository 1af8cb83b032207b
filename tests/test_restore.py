"""The layer-pipelined restore pipeline on real files: bytes, ordering, bounds, admission."""

from __future__ import annotations

import tempfile
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flatcake_ray.core.gva import Medium
from flatcake_ray.core.tenants import DEFAULT_TENANT, new_secret, seal_key
from flatcake_ray.cuda_ext.scatter import scatter_layer
from flatcake_ray.errors import RestoreTimeoutError
from flatcake_ray.media import buffers as media
from flatcake_ray.node.store import FlatCakeStore, PutHints
from flatcake_ray.restore import RestorePipeline
from tests.conftest import LAYERS, PAGE_BYTES, random_kv, small_config

DRAM = PutHints(turn=2, prior_reply_tokens=10)  # Table 2: short-turn chat goes to DRAM
SLOTS = 96
WAIT = 10.0  # seconds; generous so a slow CI box never flakes, never reached when correct


def make_pool(layout, page_bytes=PAGE_BYTES, dtype=torch.float16, slots=SLOTS):
    elems = page_bytes // torch.empty(0, dtype=dtype).element_size()
    shape = (LAYERS, slots, elems) if layout == "layer_first" else (slots, LAYERS, elems)
    return torch.zeros(shape, dtype=dtype)


def pool_pages(pool, layout, slot_ids):
    """The pool's pages at ``slot_ids`` as uint8 [layers, pages, page_bytes]."""
    ids = torch.as_tensor(np.asarray(slot_ids), dtype=torch.int64)
    pages = pool[:, ids] if layout == "layer_first" else pool[ids].transpose(0, 1)
    return pages.contiguous().view(torch.uint8).numpy()


def scattered_slots(count, seed=0, slots=SLOTS):
    return np.random.default_rng(seed).permutation(slots)[:count]


def put_turns(store, kv, cuts, hints):
    """One put per turn: turn t stores the prefix kv[:, :cuts[t]]."""
    for cut, hint in zip(cuts, hints, strict=True):
        store.put(list(range(cut)), kv[:, :cut], hints=hint)


class GatedScatter:
    """A scatter that records (pool id, layer) and can hold a pool's layers until released."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []
        self.gates: dict[tuple[int, int], threading.Event] = {}
        self.entered = threading.Event()

    def gate(self, pool, layer):
        self.gates[(id(pool), layer)] = threading.Event()
        return self.gates[(id(pool), layer)]

    def __call__(self, staging, pool, ids, layer, layout, **options):
        gate = self.gates.get((id(pool), layer))
        if gate is not None:
            self.entered.set()
            assert gate.wait(WAIT), "test gate never opened"
        scatter_layer(staging, pool, ids, layer, layout, **options)
        self.calls.append((id(pool), layer))


def wait_until(condition, timeout=WAIT):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.002)


# ---- bytes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize(
    ("source", "hints", "medium"),
    [
        ("ssd", [None, None, None], Medium.SSD),
        ("dram", [DRAM, DRAM, DRAM], Medium.DRAM),
        ("mixed", [None, DRAM, None], Medium.SSD),
    ],
)
def test_restore_is_byte_exact_in_both_layouts(
    make_store, pipelines, layout, source, hints, medium
):
    store = make_store()
    kv = random_kv(30, seed=3)
    put_turns(store, kv, [8, 20, 30], hints)
    pipeline = pipelines(store)
    pool, slots = make_pool(layout), scattered_slots(30)
    handle = pipeline.submit(list(range(30)), pool, slots, layout)
    assert handle.wait(WAIT) == 30 and handle.pages == 30 and handle.error is None
    assert handle.medium is medium and handle.done and handle.layers_done == LAYERS
    assert np.array_equal(pool_pages(pool, layout, slots), kv)
    untouched = np.setdiff1d(np.arange(SLOTS), slots)
    assert not pool_pages(pool, layout, untouched).any()
    stats = store.stats()
    assert stats["leases_open"] == 0 and stats["hit_pages"] == 30
    assert (stats["ssd_read_commands"] > 0) == (source != "dram")


def test_partial_prefix_restores_the_hits_only(make_store, pipelines):
    store = make_store()
    kv = random_kv(12, seed=4)
    store.put(list(range(12)), kv)
    pool, slots = make_pool("layer_first"), scattered_slots(20)
    handle = pipelines(store).submit(
        [*range(10), "miss", 11, 12, 13, 14, 15, 16, 17, 18, 19], pool, slots, "layer_first"
    )
    assert handle.wait(WAIT) == 10 and handle.hits == 10
    assert np.array_equal(pool_pages(pool, "layer_first", slots[:10]), kv[:, :10])
    assert not pool_pages(pool, "layer_first", slots[10:]).any()


def test_no_hits_finishes_at_once(make_store, pipelines):
    store = make_store()
    handle = pipelines(store).submit(["a", "b"], make_pool("page_first"), [0, 1], "page_first")
    assert handle.done and handle.wait(0) == 0 and handle.wait_for_layer(LAYERS - 1, 0) == 0


def test_long_layers_stream_through_small_slots_in_chunks(make_store, pipelines):
    page_bytes = 6000  # not a multiple of 4 KiB: pages straddle the slots' piece boundaries
    store = make_store(page_bytes=page_bytes)
    kv = random_kv(60, seed=5, page_bytes=page_bytes)
    put_turns(store, kv, [25, 26, 60], [None, DRAM, None])
    slot_bytes = 5 * 4096  # about 3 pages: each layer takes many chunks
    recorder = GatedScatter()
    pipeline = pipelines(store, slot_bytes=slot_bytes, scatter=recorder)
    pool, slots = make_pool("page_first", page_bytes, torch.int16), scattered_slots(60)
    assert pipeline.submit(list(range(60)), pool, slots, "page_first").wait(WAIT) == 60
    assert np.array_equal(pool_pages(pool, "page_first", slots), kv)
    layers = [layer for _, layer in recorder.calls]
    assert layers == sorted(layers) and len(layers) >= LAYERS * 60 * page_bytes // slot_bytes
    assert pipeline.high_water_bytes <= pipeline.window_bytes == 2 * 2 * slot_bytes


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_bytes=st.sampled_from([512, 4096, 5000, 12288]),
    cuts=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    on_dram=st.lists(st.booleans(), min_size=4, max_size=4),
    slot_pages=st.integers(1, 6),
    gap_bytes=st.sampled_from([0, 64 << 10]),
    wanted=st.integers(1, 60),
    sealed=st.booleans(),
)
# Sealed SSD pages of 5,000 bytes (not whole cipher blocks) through slots of about two pages.
@example(5000, [7, 9], [False, False, False, False], 2, 0, 16, True)
def test_any_layout_of_turns_restores_exactly(
    page_bytes, cuts, on_dram, slot_pages, gap_bytes, wanted, sealed
):
    """Also with the SSD pages sealed (a tenant with a key): blocks cut by a slot's end, at
    any byte of a cipher block, unseal piece by piece."""
    ends = np.cumsum(cuts).tolist()
    with tempfile.TemporaryDirectory() as root:
        store = FlatCakeStore(small_config(root, page_bytes=page_bytes, gap_bytes=gap_bytes))
        if sealed:
            store.tenancy.learn_seal(DEFAULT_TENANT, seal_key(new_secret()))
        try:
            kv = random_kv(ends[-1], seed=ends[-1], page_bytes=page_bytes)
            put_turns(store, kv, ends, [DRAM if d else None for d in on_dram[: len(ends)]])
            slot_bytes = -(-(slot_pages * page_bytes + 4096) // 4096) * 4096
            with RestorePipeline(store.source, slot_bytes=slot_bytes) as pipeline:
                pool = make_pool("layer_first", page_bytes, torch.uint8)
                count = min(wanted, ends[-1])
                slots = scattered_slots(count, seed=count)
                handle = pipeline.submit(list(range(count)), pool, slots, "layer_first")
                assert handle.wait(WAIT) == count
                assert np.array_equal(pool_pages(pool, "layer_first", slots), kv[:, :count])
        finally:
            store.close()


def test_a_page_cut_by_a_slots_end_is_checked_where_it_is_delivered_from(
    make_store, pipelines, failpoints
):
    """A page that a slot's end cuts in two is read again whole into the next slot and
    delivered from there, so its bytes are checked there: a write to the drive between the
    two reads (here: into the part the first slot also held) is a miss, never its bytes."""
    page_bytes = 6000  # not a divisor of the slot: page 3 straddles the first slot's end
    store = make_store(page_bytes=page_bytes, gap_bytes=0)
    kv = random_kv(60, seed=5, page_bytes=page_bytes)
    store.put(list(range(60)), kv, hints=PutHints(turn=1))
    file_index, at = store.pool.locate(int(store.gvas([0])[0]) & ((1 << 48) - 1))
    fills: list[int] = []

    def write_between_reads(**_context: object) -> None:
        fills.append(1)
        if len(fills) == 2:  # the first slot held pages 0-2 and the start of page 3
            with open(store.pool.paths[file_index], "r+b") as pool_file:
                pool_file.seek(at + 3 * page_bytes + 100)
                pool_file.write(b"\xff" * 200)

    failpoints.arm("source.fill", call=write_between_reads, times=None)
    pipeline = pipelines(store, slot_bytes=5 * 4096, windows=1, slot_layers=1)
    pool, slots = make_pool("layer_first", page_bytes, torch.uint8), scattered_slots(60)
    restored = pipeline.submit(list(range(60)), pool, slots, "layer_first").wait(WAIT)
    assert len(fills) > 2 and restored <= 3  # no page from the written one on
    assert np.array_equal(pool_pages(pool, "layer_first", slots)[:, :restored], kv[:, :restored])


def flip_on_drive(store: FlatCakeStore, page: int, layer: int, scope_pages: int) -> None:
    """Flip a byte of ``page``'s ``layer`` in its pool file (its scope holds ``scope_pages``
    pages: a layer's stride is their bytes, 4 KiB aligned)."""
    stride = -(-scope_pages * PAGE_BYTES // 4096) * 4096
    gva = int(store.gvas([page])[0]) & ((1 << 48) - 1)
    file_index, offset = store.pool.locate(gva + layer * stride)
    with open(store.pool.paths[file_index], "r+b") as pool_file:
        pool_file.seek(offset)
        byte = pool_file.read(1)
        pool_file.seek(offset)
        pool_file.write(bytes([byte[0] ^ 0xFF]))


def assert_checked_restore(
    store, pipeline, kv, keys, flipped_page, slots, *, blocks_whole: bool = False
) -> None:
    """Restore ``keys`` into ``slots``: it fails (its one scope quarantined) when a page it
    takes shares a 2-page checksum block with ``flipped_page``, else it is exact. With
    ``blocks_whole`` (each block read in one chunk: decided before any of its bytes lands)
    the failed restore also leaves no wrong byte in the pool."""
    pool = make_pool("layer_first")
    got = pipeline.submit(keys, pool, slots, "layer_first").wait(WAIT)
    if flipped_page // 2 in {key // 2 for key in keys}:
        assert got == 0 and store.stats()["quarantined_scopes"] == 1
        if blocks_whole:
            assert_no_wrong_byte(pool_pages(pool, "layer_first", slots), kv[:, keys])
    else:
        assert got == len(keys)
        assert np.array_equal(pool_pages(pool, "layer_first", slots), kv[:, keys])


def assert_no_wrong_byte(got: np.ndarray, kv: np.ndarray) -> None:
    """Each restored page (``[layers, pages, page_bytes]``) holds its bytes or nothing: a
    failed check leaves no wrong byte in the reader's memory."""
    exact = (got == kv).all(axis=-1)
    empty = ~got.any(axis=-1)
    assert (exact | empty).all()


def test_flipped_byte_in_a_later_layer_shrinks_the_prefix_and_quarantines(make_store, pipelines):
    store = make_store()
    kv = random_kv(20, seed=6)
    store.put(list(range(6)), kv[:, :6], hints=DRAM)  # a DRAM prompt, then an SSD scope
    store.put(list(range(20)), kv)
    flip_on_drive(store, 10, 2, scope_pages=14)  # layer 2 of page 10
    pool, slots = make_pool("layer_first"), scattered_slots(20)
    handle = pipelines(store).submit(list(range(20)), pool, slots, "layer_first")
    assert handle.wait(WAIT) == 6
    assert np.array_equal(pool_pages(pool, "layer_first", slots[:6]), kv[:, :6])
    assert store.exists(list(range(20))) == 6 and store.stats()["quarantined_scopes"] == 1


def test_verify_dram_checks_arena_extents_too(make_store, pipelines):
    store = make_store(verify_dram=True)
    kv = random_kv(12, seed=9)
    put_turns(store, kv, [5, 12], [DRAM, None])  # a DRAM scope, then an SSD one
    pool, slots = make_pool("layer_first"), scattered_slots(12)
    pipeline = pipelines(store, slot_bytes=2 * PAGE_BYTES + 4096)  # DRAM runs span chunks too
    assert pipeline.submit(list(range(12)), pool, slots, "layer_first").wait(WAIT) == 12
    assert np.array_equal(pool_pages(pool, "layer_first", slots), kv)
    gva = int(store.gvas([3])[0])  # a DRAM GVA is its arena offset
    store.arena.view[gva + 3 * 5 * PAGE_BYTES] ^= 0xFF  # layer 3 of page 3
    assert pipeline.submit(list(range(12)), pool, slots, "layer_first").wait(WAIT) == 0
    assert store.stats()["quarantined_scopes"] == 1


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    wanted=st.sets(st.integers(0, 23), min_size=1),
    flipped=st.tuples(st.integers(0, LAYERS - 1), st.integers(0, 23)),
    slot_pages=st.integers(2, 9),
    consecutive=st.booleans(),
)
def test_a_checked_dram_restore_checks_each_block_it_takes_pages_of_and_no_other(
    native_pass, wanted, flipped, slot_pages, consecutive
):
    """With ``verify_dram``, a restore of any pages of an arena extent (runs with gaps, blocks
    cut between chunks; into consecutive slots, copied and checked in one pass, or scattered
    ones, each block copied into its slots and hashed in one pass by the AVX2 pass and
    through a private copy by the plain one) fails on a byte flipped in a block holding a
    page it takes, leaving no wrong byte in the pool, and not on one flipped in a block it
    takes nothing of."""
    keys = sorted(wanted)
    layer, page = flipped
    with tempfile.TemporaryDirectory() as root:
        store = FlatCakeStore(small_config(root, verify_dram=True, check_bytes=2 * PAGE_BYTES))
        pipeline = RestorePipeline(store.source, slot_bytes=slot_pages * PAGE_BYTES + 4096)
        try:
            kv = random_kv(24, seed=11)
            store.put(list(range(24)), kv, hints=DRAM)
            gva = int(store.gvas([page])[0])  # a DRAM GVA is its arena offset; one scope
            store.arena.view[gva + layer * 24 * PAGE_BYTES] ^= 0xFF
            slots = np.arange(len(keys)) if consecutive else scattered_slots(len(keys), seed=2)
            assert_checked_restore(store, pipeline, kv, keys, page, slots, blocks_whole=True)
        finally:
            pipeline.close()
            store.close()


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    wanted=st.sets(st.integers(0, 23), min_size=1),
    flipped=st.tuples(st.integers(0, LAYERS - 1), st.integers(0, 23)),
    slot_pages=st.integers(1, 9),
    consecutive=st.booleans(),
)
def test_an_ssd_restore_checks_each_block_it_takes_pages_of_whatever_the_slots_cut(
    native_pass, wanted, flipped, slot_pages, consecutive
):
    """An SSD restore's blocks are checked as rows where a slot holds them whole and piece by
    piece where slots cut them: a byte flipped on the drive in a block holding a page the
    restore takes fails it, whatever the slot size, the destination and the native pass;
    one flipped in a block it takes nothing of does not."""
    keys = sorted(wanted)
    layer, page = flipped
    with tempfile.TemporaryDirectory() as root:
        store = FlatCakeStore(small_config(root, check_bytes=2 * PAGE_BYTES))
        pipeline = RestorePipeline(store.source, slot_bytes=slot_pages * PAGE_BYTES + 4096)
        try:
            kv = random_kv(24, seed=12)
            store.put(list(range(24)), kv)
            flip_on_drive(store, page, layer, scope_pages=24)
            slots = np.arange(len(keys)) if consecutive else scattered_slots(len(keys), seed=3)
            assert_checked_restore(store, pipeline, kv, keys, page, slots)
        finally:
            pipeline.close()
            store.close()


# ---- layer ordering and double buffering -----------------------------------------------------


def test_wait_for_layer_returns_when_that_layer_and_no_later_one_is_in_place(make_store, pipelines):
    store = make_store()
    kv = random_kv(16, seed=7)
    store.put(list(range(16)), kv)
    recorder = GatedScatter()
    # A slot holding one layer: layers move one group each (a short restore whose layers all
    # fit one slot is read in one command and its layers land together).
    pipeline = pipelines(store, scatter=recorder, slot_bytes=16 * PAGE_BYTES)
    pool, slots = make_pool("page_first"), scattered_slots(16)
    gates = [recorder.gate(pool, layer) for layer in range(LAYERS)]
    handle = pipeline.submit(list(range(16)), pool, slots, "page_first")
    for layer in range(LAYERS):
        with pytest.raises(RestoreTimeoutError):
            handle.wait_for_layer(layer, timeout=0.05)
        gates[layer].set()
        assert handle.wait_for_layer(layer, WAIT) == 16
        got = pool_pages(pool, "page_first", slots)
        assert np.array_equal(got[: layer + 1], kv[: layer + 1])
        assert not got[layer + 1 :].any()
    assert handle.wait(WAIT) == 16
    assert [layer for _, layer in recorder.calls] == list(range(LAYERS))


def test_next_layer_is_read_while_this_one_is_scattered(make_store, pipelines, failpoints):
    store = make_store()
    store.put(list(range(16)), random_kv(16, seed=8))
    filled: list[int] = []  # a layer's read is counted as it starts, in its slot
    failpoints.arm("source.fill", call=lambda **_: filled.append(len(filled)), times=None)
    recorder = GatedScatter()
    slot_bytes = 16 * PAGE_BYTES  # one layer per slot
    pipeline = pipelines(store, windows=1, scatter=recorder, slot_bytes=slot_bytes)
    pool = make_pool("layer_first")
    gate = recorder.gate(pool, 0)
    handle = pipeline.submit(list(range(16)), pool, scattered_slots(16), "layer_first")
    assert recorder.entered.wait(WAIT)  # layer 0 is being scattered ...
    wait_until(lambda: filled == [0, 1])  # ... while layer 1 is read into the other slot
    time.sleep(0.05)
    assert filled == [0, 1], "a third layer was read with both slots of the window taken"
    assert pipeline.held_bytes == pipeline.high_water_bytes == 2 * slot_bytes
    gate.set()
    assert handle.wait(WAIT) == 16 and filled == list(range(LAYERS))
    assert pipeline.held_bytes == 0


# ---- bounded memory, admission, no revocation --------------------------------------------------


def test_window_bound_holds_under_many_concurrent_restores(make_store, pipelines, monkeypatch):
    store = make_store(ssd_file_bytes=16 << 20)
    sessions = {s: random_kv(6 + 5 * s, seed=10 + s) for s in range(8)}
    for s, kv in sessions.items():
        store.put([f"{s}-{i}" for i in range(kv.shape[1])], kv, hints=DRAM if s % 3 == 0 else None)
    slot_bytes = 8 * 4096
    pipeline = pipelines(store, windows=2, slot_bytes=slot_bytes)
    allocations: list[int] = []
    real_init = media.AlignedBuffer.__init__

    def counting_init(self, nbytes):
        allocations.append(nbytes)
        real_init(self, nbytes)

    monkeypatch.setattr(media.AlignedBuffer, "__init__", counting_init)
    failures: list[str] = []

    def client(worker):
        for round_ in range(4):
            s = (worker + round_) % len(sessions)
            kv = sessions[s]
            pool, slots = make_pool("page_first"), scattered_slots(kv.shape[1], seed=worker)
            keys = [f"{s}-{i}" for i in range(kv.shape[1])]
            handle = pipeline.submit(keys, pool, slots, "page_first")
            if handle.wait(WAIT) != kv.shape[1]:
                failures.append(f"worker {worker} session {s}: {handle.pages} pages")
            elif not np.array_equal(pool_pages(pool, "page_first", slots), kv):
                failures.append(f"worker {worker} session {s}: wrong bytes")

    threads = [threading.Thread(target=client, args=(w,)) for w in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert allocations == []  # no staging memory beyond what the pipeline made at the start
    assert pipeline.window_bytes == 2 * 2 * slot_bytes
    assert 0 < pipeline.high_water_bytes <= pipeline.window_bytes
    stats = pipeline.scheduler.stats()
    assert stats.max_inflight_prefetches_seen <= 2 and stats.cancelled == 0
    assert store.stats()["leases_open"] == 0


def test_window_memory_does_not_grow_with_context_length(make_store, pipelines):
    store = make_store(ssd_file_bytes=16 << 20)
    short, long_ = random_kv(2, seed=11), random_kv(200, seed=12)
    store.put(["s0", "s1"], short)
    store.put([f"l{i}" for i in range(200)], long_)
    pipeline = pipelines(store, slot_bytes=4 * PAGE_BYTES)
    before = pipeline.window_bytes
    pool = make_pool("layer_first", slots=200)
    assert pipeline.submit(["s0", "s1"], pool, [0, 1], "layer_first").wait(WAIT) == 2
    high_short = pipeline.high_water_bytes
    handle = pipeline.submit([f"l{i}" for i in range(200)], pool, np.arange(200), "layer_first")
    assert handle.wait(WAIT) == 200
    assert np.array_equal(pool_pages(pool, "layer_first", np.arange(200)), long_)
    assert pipeline.window_bytes == before and pipeline.high_water_bytes <= before
    assert high_short <= pipeline.high_water_bytes  # the long one used the same slots


def test_restores_queued_behind_busy_windows_wait_and_are_never_revoked(make_store, pipelines):
    store = make_store()
    sessions = [random_kv(8, seed=20 + s) for s in range(4)]
    for s, kv in enumerate(sessions):
        store.put([f"{s}-{i}" for i in range(8)], kv)
    recorder = GatedScatter()
    pipeline = pipelines(store, windows=1, scatter=recorder)
    pools = [make_pool("layer_first") for _ in sessions]
    gate = recorder.gate(pools[0], 0)
    handles = [
        pipeline.submit([f"{s}-{i}" for i in range(8)], pools[s], np.arange(8), "layer_first")
        for s in range(4)
    ]
    assert recorder.entered.wait(WAIT)
    time.sleep(0.05)
    assert [h.started_at is not None for h in handles] == [True, False, False, False]
    assert not any(h.done for h in handles)
    assert pipeline.scheduler.stats().waiting_prefetch == 3
    gate.set()
    for s, handle in enumerate(handles):
        assert handle.wait(WAIT) == 8 and handle.error is None
        assert np.array_equal(pool_pages(pools[s], "layer_first", np.arange(8)), sessions[s])
    assert pipeline.scheduler.stats().cancelled == 0


@pytest.mark.parametrize("policy", ["fc-mas", "fcfs"])
def test_dram_ready_restore_is_not_held_behind_a_long_ssd_restore(make_store, pipelines, policy):
    store = make_store()
    long_kv, chat_kv = random_kv(40, seed=30), random_kv(4, seed=31)
    store.put([f"long{i}" for i in range(40)], long_kv)
    store.put([f"chat{i}" for i in range(4)], chat_kv, hints=DRAM)
    recorder = GatedScatter()
    pipeline = pipelines(store, windows=1, policy=policy, scatter=recorder)
    long_pool, chat_pool = make_pool("page_first", slots=40), make_pool("page_first")
    gate = recorder.gate(long_pool, 1)
    long_handle = pipeline.submit(
        [f"long{i}" for i in range(40)], long_pool, np.arange(40), "page_first"
    )
    assert recorder.entered.wait(WAIT)  # the SSD restore holds the only window
    chat = pipeline.submit([f"chat{i}" for i in range(4)], chat_pool, [9, 3, 7, 1], "page_first")
    assert chat.medium is Medium.DRAM
    if policy == "fc-mas":
        assert chat.wait(WAIT) == 4 and not long_handle.done
    else:  # the ablation: one line, the DRAM hit waits for the SSD restore ahead of it
        with pytest.raises(RestoreTimeoutError):
            chat.wait(0.2)
    gate.set()
    assert chat.wait(WAIT) == 4 and long_handle.wait(WAIT) == 40
    assert np.array_equal(pool_pages(chat_pool, "page_first", [9, 3, 7, 1]), chat_kv)
    assert (chat.finished_at < long_handle.finished_at) == (policy == "fc-mas")
