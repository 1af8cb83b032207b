"""Restores into per-layer destinations (vLLM's KV caches: one tensor per layer, any of its
layouts) and into GPU memory."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from flatcake_ray.core.gva import Medium
from flatcake_ray.core.plan import FILL_GROUP_BYTES
from flatcake_ray.cuda_ext.scatter import scatter_layer
from flatcake_ray.errors import RestoreTimeoutError, ShapeError
from flatcake_ray.restore import LayerTensors, PagedPool
from tests.conftest import LAYERS, PAGE_BYTES, random_kv
from tests.test_restore import (
    DRAM,
    WAIT,
    assert_no_wrong_byte,
    flip_on_drive,
    make_pool,
    pool_pages,
    put_turns,
    scattered_slots,
)

# ---- per-layer destinations (vLLM's KV caches) ------------------------------------------------

BLOCKS = 40


def layer_tensors(shape, device):
    return [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]


def contiguous_layers(device="cpu"):
    """vLLM's CPU caches: one [blocks, heads, block, 2 * head] bf16 tensor per layer."""
    return layer_tensors((BLOCKS, 2, 32, 64), device)


def kv_first_layers(device="cpu"):
    """A K/V-first physical layout [2, blocks, block, heads, head] seen block first: a page
    is the block's K half, then its V half, far apart in memory."""
    return [t.transpose(0, 1) for t in layer_tensors((2, BLOCKS, 32, 2, 32), device)]


def head_major_layers(device="cpu"):
    """[blocks, block, heads, head] over [blocks, heads, block, head] memory: 64 pieces."""
    return [t.transpose(1, 2) for t in layer_tensors((BLOCKS, 2, 32, 64), device)]


def saved_pages(tensors, block_ids):
    """What vLLM's connector saves: tensor[blocks] in logical order, as bytes per page."""
    ids = torch.as_tensor(np.asarray(block_ids), dtype=torch.int64)
    return np.stack([t.view(torch.uint8)[ids].reshape(len(ids), -1).numpy() for t in tensors])


@pytest.mark.parametrize("make_layers", [contiguous_layers, kv_first_layers, head_major_layers])
@pytest.mark.parametrize("hints", [[None, None], [DRAM, None], [DRAM, DRAM]])
@pytest.mark.parametrize("verify_dram", [False, True])
def test_per_layer_tensors_restore_byte_exact(
    make_store, pipelines, make_layers, hints, verify_dram, native_pass
):
    store = make_store(verify_dram=verify_dram)
    kv = random_kv(24, seed=60)
    put_turns(store, kv, [9, 24], hints)
    tensors = make_layers()
    blocks = scattered_slots(24, seed=61, slots=BLOCKS)
    pipeline = pipelines(store, slot_bytes=3 * PAGE_BYTES + 4096)  # layers span chunks
    handle = pipeline.submit(list(range(24)), LayerTensors(tensors, blocks))
    assert handle.wait(WAIT) == 24 and handle.layers_done == LAYERS
    assert np.array_equal(saved_pages(tensors, blocks), kv)
    untouched = np.setdiff1d(np.arange(BLOCKS), blocks)
    assert not saved_pages(tensors, untouched).any()


@pytest.mark.parametrize("medium", ["DRAM", "SSD"])
def test_a_wrong_block_in_kv_planes_shrinks_the_restore_and_leaves_no_wrong_byte(
    make_store, pipelines, native_pass, medium
):
    """A checked restore into vLLM's K/V planes (each page two pieces far apart) copies each
    checksum block straight into its pieces and hashes it there (the AVX2 pass), or through a
    private copy (the plain one): a byte flipped in the second put's pages fails that scope
    only, and none of its pages holds a wrong byte (each its bytes or nothing), the first
    put's exact."""
    store = make_store(verify_dram=True)
    kv = random_kv(24, seed=64)
    hints = DRAM if medium == "DRAM" else None
    store.put(list(range(9)), kv[:, :9], hints=hints)
    store.put(list(range(9, 24)), kv[:, 9:], hints=hints)  # no parent: a scope of its own
    page, layer = 17, 2
    if medium == "DRAM":
        gva = int(store.gvas([page])[0])  # a DRAM GVA is its arena offset; 15 pages a layer
        store.arena.view[gva + layer * 15 * PAGE_BYTES + 100] ^= 0xFF
    else:
        flip_on_drive(store, page, layer, scope_pages=15)
    tensors = kv_first_layers()
    blocks = scattered_slots(24, seed=65, slots=BLOCKS)
    handle = pipelines(store).submit(list(range(24)), LayerTensors(tensors, blocks))
    assert handle.wait(WAIT) == 9 and store.stats()["quarantined_scopes"] == 1
    got = saved_pages(tensors, blocks)
    assert np.array_equal(got[:, :9], kv[:, :9])
    assert_no_wrong_byte(got[:, 9:], kv[:, 9:])


def test_per_layer_wait_returns_with_that_layer_in_place(make_store, pipelines):
    store = make_store()
    kv = random_kv(8, seed=62)
    store.put(list(range(8)), kv)
    tensors = contiguous_layers()
    opened = threading.Event()

    def gated(staging, pool, ids, layer, layout, **options):
        if pool.data_ptr() == tensors[1].data_ptr():
            assert opened.wait(WAIT), "test gate never opened"
        scatter_layer(staging, pool, ids, layer, layout, **options)

    pipeline = pipelines(store, scatter=gated)
    handle = pipeline.submit(list(range(8)), LayerTensors(tensors, np.arange(8)))
    assert handle.wait_for_layer(0, WAIT) == 8
    assert np.array_equal(saved_pages(tensors[:1], np.arange(8)), kv[:1])
    with pytest.raises(RestoreTimeoutError):
        handle.wait_for_layer(1, timeout=0.05)
    assert not saved_pages(tensors[1:], np.arange(8)).any()
    opened.set()
    assert handle.wait(WAIT) == 8
    assert np.array_equal(saved_pages(tensors, np.arange(8)), kv)


def test_bad_destinations_are_typed_errors(make_store, pipelines):
    store = make_store()
    store.put(list(range(4)), random_kv(4))
    pipeline = pipelines(store)
    tensors = contiguous_layers()
    keys = list(range(4))
    with pytest.raises(ShapeError):
        LayerTensors(tensors, [0, 1, 2, BLOCKS])  # a block out of range
    with pytest.raises(ShapeError):
        LayerTensors(tensors, [0, 1, 1, 2])
    with pytest.raises(ShapeError):
        LayerTensors([tensors[0], tensors[1][:, :1]], [0])  # layers differ in page bytes
    with pytest.raises(ShapeError):
        LayerTensors([t.transpose(-1, -2) for t in tensors], [0])  # last axis strided
    halves = kv_first_layers()  # K and V planes; then each block's pieces half a piece on
    piece = 32 * 2 * 32
    overlapping = [t.as_strided(t.shape, (piece // 2, *t.stride()[1:])) for t in halves]
    with pytest.raises(ShapeError, match="overlap"):
        LayerTensors(overlapping, [0])  # blocks sharing bytes: refused before any is written
    whole = [t.as_strided(t.shape, (t.stride(0) // 2, *t.stride()[1:])) for t in tensors]
    with pytest.raises(ShapeError, match="overlap"):
        LayerTensors(whole, [0])  # one piece a block, each half over the next
    with pytest.raises(ShapeError):
        pipeline.submit(keys, LayerTensors(tensors[:3], [0, 1, 2, 3]))  # 3 of 4 layers
    with pytest.raises(ShapeError):
        pipeline.submit(keys, LayerTensors(tensors, [0, 1, 2]))  # a block short
    with pytest.raises(ShapeError):
        pipeline.submit(keys, LayerTensors(tensors, [0, 1, 2, 3]), [0, 1, 2, 3])
    with pytest.raises(ShapeError):
        pipeline.submit(keys, make_pool("layer_first"))  # a pool needs its slot ids
    pool = make_pool("page_first")
    assert pipeline.submit(keys, PagedPool(pool, [3, 2, 1, 0], "page_first")).wait(WAIT) == 4
    assert np.array_equal(pool_pages(pool, "page_first", [3, 2, 1, 0]), random_kv(4))
    assert store.stats()["leases_open"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_pipelines_host_slots_are_page_locked_until_it_closes(make_store, pipelines):
    """Every chunk read into a host slot crosses to the GPU from it: page-locked, the copy is
    DMA, not staged by the driver."""
    store = make_store()
    pipeline = pipelines(store, device="cuda", windows=2, slot_layers=2, slot_bytes=4 * 4096)
    assert pipeline.pinned_bytes == 2 * 2 * 4 * 4096
    pipeline.close()
    assert pipeline.pinned_bytes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_restore_into_a_gpu_pool_is_byte_exact(make_store, pipelines, layout):
    page_bytes = 6000
    store = make_store(page_bytes=page_bytes)
    kv = random_kv(40, seed=50, page_bytes=page_bytes)
    put_turns(store, kv, [10, 18, 40], [None, DRAM, None])
    pipeline = pipelines(store, device="cuda", slot_bytes=4 * 4096)
    pool = make_pool(layout, page_bytes, torch.int16).cuda()
    slots = scattered_slots(40)
    handles = [pipeline.submit(list(range(40)), pool, slots, layout) for _ in range(3)]
    handles.append(pipeline.submit(list(range(18)), pool, slots[:18], layout))  # DRAM lane
    assert [h.wait(WAIT) for h in handles] == [40, 40, 40, 18]
    assert np.array_equal(pool_pages(pool.cpu(), layout, slots), kv)
    assert pipeline.window_bytes == 2 * 2 * 4 * 4096 * 2 + 2 * 4 * 4096  # host + HBM twins


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("make_layers", [contiguous_layers, kv_first_layers])
def test_per_layer_gpu_tensors_restore_byte_exact(make_store, pipelines, make_layers):
    store = make_store()
    kv = random_kv(24, seed=65)
    put_turns(store, kv, [9, 24], [DRAM, None])
    tensors = make_layers("cuda")
    blocks = scattered_slots(24, seed=66, slots=BLOCKS)
    pipeline = pipelines(store, device="cuda", slot_bytes=3 * PAGE_BYTES + 4096)
    assert pipeline.submit(list(range(24)), LayerTensors(tensors, blocks)).wait(WAIT) == 24
    assert np.array_equal(saved_pages([t.cpu() for t in tensors], blocks), kv)


def test_an_ssd_restore_of_small_layers_delivers_its_first_layer_before_reading_the_rest(
    make_store, pipelines, failpoints
):
    """An engine waits for its KV layer by layer: a restore from SSD whose layers are small
    reads them in groups of ``FILL_GROUP_BYTES``, so layer 0 is in place while the drive
    reads the next group (in groups of a whole slot, all four layers were one read)."""
    pages = 160  # 1.25 MiB a layer: one layer a group of FILL_GROUP_BYTES, 4 in a 16 MiB slot
    assert pages * PAGE_BYTES <= FILL_GROUP_BYTES < 2 * pages * PAGE_BYTES
    store = make_store(ssd_file_bytes=32 << 20, dram_bytes=8 << 20)
    kv = random_kv(pages, seed=63)
    assert store.put(list(range(pages)), kv).medium is Medium.SSD
    opened, fills = threading.Event(), []

    def second_fill_waits(medium):
        fills.append(medium)
        if len(fills) == 2:
            assert opened.wait(WAIT), "test gate never opened"

    failpoints.arm("source.fill", call=second_fill_waits, times=None)
    pipeline = pipelines(store)  # the default slot: 16 MiB, room for every layer
    out = np.zeros_like(kv)
    handle = pipeline.submit(list(range(pages)), PagedPool(out, np.arange(pages)))
    assert handle.wait_for_layer(0, WAIT) == pages
    assert np.array_equal(out[0], kv[0])
    assert handle.layers_done < LAYERS and not out[LAYERS - 1].any()
    opened.set()
    assert handle.wait(WAIT) == pages
    assert np.array_equal(out, kv) and fills == [Medium.SSD] * LAYERS
