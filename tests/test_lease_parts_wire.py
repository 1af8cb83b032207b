"""A lease's parts as they cross the wire (``core/parts.py``): a run of consecutive pages
travels as its first page and length, anything else as its array, and either arrives as the
same pages at the same positions."""

from __future__ import annotations

import pickle

import numpy as np

from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.keys import request_digests
from flatcake_ray.core.parts import lease_parts
from tests.conftest import LAYERS, PAGE_BYTES

DRAM = PutHints(turn=2, prior_reply_tokens=1)


def test_a_whole_prefix_travels_as_a_run_and_arrives_as_the_same_pages(make_store) -> None:
    store = make_store()
    keys = [f"run/{i}" for i in range(200)]
    store.put(keys, np.ones((LAYERS, 200, PAGE_BYTES), np.uint8), session_id="run", hints=DRAM)
    lease = store.lease(request_digests(keys, None))
    try:
        (part,) = lease_parts(lease)
        wire = pickle.dumps(part)
        back = pickle.loads(wire)
        assert len(wire) < part.src_pages.nbytes  # not 8 bytes a page
        assert np.array_equal(back.src_pages, part.src_pages) and back.src_pages.dtype == np.int64
        assert np.array_equal(back.dst_positions, np.arange(200))
        assert (back.scope_id, back.medium, back.offset) == (
            part.scope_id,
            part.medium,
            part.offset,
        )
        assert np.array_equal(back.checksums, part.checksums)
    finally:
        store.release(lease)


def test_pages_that_are_not_a_run_travel_as_they_are(make_store) -> None:
    store = make_store()
    keys = [f"gap/{i}" for i in range(8)]
    store.put(keys, np.ones((LAYERS, 8, PAGE_BYTES), np.uint8), session_id="gap", hints=DRAM)
    lease = store.lease(request_digests(keys, None))
    try:
        (part,) = lease_parts(lease)
        scattered = part.at_positions(np.array([7, 0, 3, 1, 2, 4, 6, 5], dtype=np.int64))
        back = pickle.loads(pickle.dumps(scattered))
        assert np.array_equal(back.dst_positions, scattered.dst_positions)
        assert np.array_equal(back.src_pages, part.src_pages)
    finally:
        store.release(lease)
