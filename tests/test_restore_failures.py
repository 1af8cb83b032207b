"""The restore pipeline when things go wrong: worker and planning errors, bad arguments, closing
while restores run, and failures of its own bookkeeping never leave a waiter blocked."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from flatcake_ray.core.gva import Medium
from flatcake_ray.cuda_ext.scatter import scatter_layer
from flatcake_ray.errors import (
    ConfigError,
    RestoreError,
    RestoreTimeoutError,
    ShapeError,
    StoreClosedError,
)
from flatcake_ray.restore import RestorePipeline
from tests.conftest import LAYERS, PAGE_BYTES, random_kv
from tests.test_restore import (
    DRAM,
    SLOTS,
    WAIT,
    GatedScatter,
    make_pool,
    pool_pages,
    scattered_slots,
)

# ---- errors and lifecycle --------------------------------------------------------------------


def test_a_worker_exception_is_raised_by_wait_and_the_window_recovers(make_store, pipelines):
    store = make_store()
    kv = random_kv(8, seed=40)
    store.put(list(range(8)), kv)
    broken = make_pool("layer_first")

    def failing_scatter(staging, pool, ids, layer, layout, **options):
        if pool is broken and layer == 2:
            raise RuntimeError("device lost")
        scatter_layer(staging, pool, ids, layer, layout, **options)

    pipeline = pipelines(store, windows=1, scatter=failing_scatter)
    handle = pipeline.submit(list(range(8)), broken, np.arange(8), "layer_first")
    with pytest.raises(RestoreError) as caught:
        handle.wait(WAIT)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert isinstance(handle.error, RuntimeError)
    with pytest.raises(RestoreError):
        handle.wait_for_layer(0, WAIT)
    pool = make_pool("layer_first")
    assert pipeline.submit(list(range(8)), pool, np.arange(8), "layer_first").wait(WAIT) == 8
    assert np.array_equal(pool_pages(pool, "layer_first", np.arange(8)), kv)
    assert store.stats()["leases_open"] == 0 and pipeline.scheduler.stats().cancelled == 1


def test_close_lets_submitted_restores_finish(make_store):
    store = make_store()
    kv = random_kv(10, seed=41)
    store.put(list(range(10)), kv)
    pipeline = RestorePipeline(store.source, windows=1)
    pools = [make_pool("layer_first") for _ in range(5)]
    handles = [pipeline.submit(list(range(10)), p, np.arange(10), "layer_first") for p in pools]
    pipeline.close()
    assert all(h.done and h.pages == 10 for h in handles)
    with pytest.raises(StoreClosedError):
        pipeline.submit(list(range(10)), pools[0], np.arange(10), "layer_first")
    pipeline.close()  # idempotent


def test_bad_arguments_are_typed_errors(make_store, pipelines):
    store = make_store()
    store.put(list(range(4)), random_kv(4))
    pipeline = pipelines(store)
    pool = make_pool("layer_first")
    keys = list(range(4))
    with pytest.raises(ShapeError):
        pipeline.submit(keys, pool, [0, 1, 2], "layer_first")  # one slot id short
    with pytest.raises(ShapeError):
        pipeline.submit(keys, pool, [0, 1, 1, 2], "layer_first")  # repeated slot
    with pytest.raises(ShapeError):
        pipeline.submit(keys, pool, [0, 1, 2, SLOTS], "layer_first")  # out of range
    with pytest.raises(ShapeError):
        pipeline.submit(keys, pool, [0, 1, 2, 3], "layer_last")
    with pytest.raises(ShapeError):
        pipeline.submit(keys, make_pool("layer_first", PAGE_BYTES // 2), [0, 1, 2, 3])
    with pytest.raises(ShapeError):
        pipeline.submit(keys, pool.transpose(0, 1), [0, 1, 2, 3], "layer_first")  # 96 layers
    frozen = np.zeros((LAYERS, 8, PAGE_BYTES), dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ShapeError):
        pipeline.submit(keys, frozen, [0, 1, 2, 3])
    array_pool = np.zeros((LAYERS, 8, PAGE_BYTES), dtype=np.uint8)  # numpy pools work too
    assert pipeline.submit(keys, array_pool, [7, 5, 3, 1]).wait(WAIT) == 4
    assert np.array_equal(array_pool[:, [7, 5, 3, 1]], random_kv(4))
    handle = pipeline.submit(keys, pool, [0, 1, 2, 3])
    with pytest.raises(ShapeError):
        handle.wait_for_layer(LAYERS)
    assert handle.wait(WAIT) == 4 and store.stats()["leases_open"] == 0
    with pytest.raises(ConfigError):
        RestorePipeline(store.source, slot_bytes=PAGE_BYTES)  # a page plus 4 KiB must fit
    with pytest.raises(ConfigError):
        RestorePipeline(store.source, windows=0)


# ---- failures of the bookkeeping itself never leave a waiter or close() blocked -------------


def test_a_failing_scheduler_fails_queued_restores_and_close_returns(
    make_store, pipelines, failpoints
):
    store = make_store()
    kv = random_kv(8, seed=63)
    store.put(list(range(8)), kv)
    recorder = GatedScatter()
    pipeline = pipelines(store, windows=1, scatter=recorder)
    pools = [make_pool("layer_first") for _ in range(3)]
    gate = recorder.gate(pools[0], 0)
    handles = [pipeline.submit(list(range(8)), p, np.arange(8), "layer_first") for p in pools]
    assert recorder.entered.wait(WAIT)

    failpoints.arm("scheduler.prefetch_done", raises=RuntimeError("bookkeeping lost"), times=None)
    gate.set()
    assert handles[0].wait(WAIT) == 8  # its bytes were in place before the bookkeeping failed
    for handle in handles[1:]:  # queued behind it: failed with the scheduler's error
        with pytest.raises(RestoreError) as caught:
            handle.wait(WAIT)
        assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(RestoreError):
        pipeline.submit(list(range(8)), pools[1], np.arange(8), "layer_first")
    pipeline.close(timeout=WAIT)
    assert store.stats()["leases_open"] == 0


def test_a_failing_dispatch_at_submit_reaches_wait(make_store, pipelines, failpoints):
    store = make_store()
    store.put(list(range(4)), random_kv(4))
    pipeline = pipelines(store)
    failpoints.arm("scheduler.start_prefetches", raises=RuntimeError("no budget"), times=None)
    handle = pipeline.submit(list(range(4)), make_pool("layer_first"), np.arange(4))
    with pytest.raises(RestoreError) as caught:
        handle.wait(WAIT)
    assert isinstance(caught.value.__cause__, RuntimeError)
    pipeline.close(timeout=WAIT)
    assert store.stats()["leases_open"] == 0


@pytest.mark.parametrize("hint", [None, DRAM])
def test_a_planning_error_reaches_wait_and_the_lane_lives_on(
    make_store, pipelines, failpoints, hint
):
    store = make_store()
    kv = random_kv(6, seed=64)
    medium = store.put(list(range(6)), kv, hints=hint).medium
    armed = threading.Event()
    armed.set()

    def lose_the_plan(first, end):
        if first == 1 and armed.is_set():  # once: the next restore plans normally
            armed.clear()
            raise RuntimeError("plan lost")

    failpoints.arm("plan.chunks", call=lose_the_plan, times=None)
    # A layer per group: a filled slot holds less than a layer, and a mapped restore into
    # host pages that are not back to back copies four slots' bytes (one layer here) at a
    # time.
    pipeline = pipelines(store, windows=1, slot_bytes=PAGE_BYTES + 4096)
    slots = scattered_slots(6, seed=3)
    handle = pipeline.submit(list(range(6)), make_pool("layer_first"), slots)
    with pytest.raises(RestoreError) as caught:
        handle.wait(WAIT)
    assert isinstance(caught.value.__cause__, RuntimeError)
    # A restore that reads SSD is planned whole before its first read (its fills are
    # announced to the source), so no layer of it was delivered; one of mapped DRAM is planned
    # as it goes, so the layer planned before the failure may be in place.
    assert handle.layers_done == (0 if medium is Medium.SSD else 1)
    pool = make_pool("layer_first")
    assert pipeline.submit(list(range(6)), pool, slots).wait(WAIT) == 6
    assert np.array_equal(pool_pages(pool, "layer_first", slots), kv)
    assert store.stats()["leases_open"] == 0


def test_close_with_a_timeout_raises_while_a_restore_runs(make_store):
    store = make_store()
    store.put(list(range(4)), random_kv(4))
    recorder = GatedScatter()
    pipeline = RestorePipeline(store.source, windows=1, scatter=recorder)
    pool = make_pool("layer_first")
    gate = recorder.gate(pool, 0)
    handle = pipeline.submit(list(range(4)), pool, np.arange(4))
    assert recorder.entered.wait(WAIT)
    with pytest.raises(RestoreTimeoutError):
        pipeline.close(timeout=0.05)
    with pytest.raises(StoreClosedError):  # closing already refuses new restores
        pipeline.submit(list(range(4)), pool, np.arange(4))
    gate.set()
    pipeline.close(timeout=WAIT)
    assert handle.done and handle.pages == 4
    closers = [threading.Thread(target=pipeline.close) for _ in range(3)]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(WAIT)
    assert not any(closer.is_alive() for closer in closers)
