"""A lease's parts as they cross the wire (``core/parts.py``): a run of consecutive pages
travels as its first page and length, anything else as its array, and either arrives as the
same pages at the same positions."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.keys import request_digests
from flatcake_ray.core.parts import LeasePart, lease_parts
from tests.conftest import LAYERS, PAGE_BYTES

DRAM = PutHints(turn=2, prior_reply_tokens=1)


@contextmanager
def one_part(store, name: str, pages: int) -> Iterator[LeasePart]:
    """The one part of a lease of ``pages`` pages put in one DRAM session (released after)."""
    keys = [f"{name}/{i}" for i in range(pages)]
    kv = np.ones((LAYERS, pages, PAGE_BYTES), np.uint8)
    store.put(keys, kv, session_id=name, hints=DRAM)
    lease = store.lease(request_digests(keys, None))
    try:
        (part,) = lease_parts(lease)
        yield part
    finally:
        store.release(lease)


def test_a_whole_prefix_travels_as_a_run_and_arrives_as_the_same_pages(make_store) -> None:
    with one_part(make_store(), "run", 200) as part:
        wire = pickle.dumps(part)
        back = pickle.loads(wire)
        assert len(wire) < part.src_pages.nbytes  # not 8 bytes a page
        assert np.array_equal(back.src_pages, part.src_pages) and back.src_pages.dtype == np.int64
        assert np.array_equal(back.dst_positions, np.arange(200))
        fields = ("scope_id", "medium", "offset", "layout")
        assert [getattr(back, f) for f in fields] == [getattr(part, f) for f in fields]
        assert np.array_equal(back.checksums, part.checksums)


def test_pages_that_are_not_a_run_travel_as_they_are(make_store) -> None:
    with one_part(make_store(), "gap", 8) as part:
        scattered = part.at_positions(np.array([7, 0, 3, 1, 2, 4, 6, 5], dtype=np.int64))
        back = pickle.loads(pickle.dumps(scattered))
        assert np.array_equal(back.dst_positions, scattered.dst_positions)
        assert np.array_equal(back.src_pages, part.src_pages)


def test_a_sealed_part_arrives_sealed(make_store) -> None:
    """The reader unseals a part's SSD bytes only if the part says they are sealed."""
    from flatcake_ray.core.tenants import DEFAULT_TENANT, new_secret, seal_key

    store = make_store()
    store.tenancy.learn_seal(DEFAULT_TENANT, seal_key(new_secret()))
    keys = [f"sealed/{i}" for i in range(5)]
    store.put(keys, np.ones((LAYERS, 5, PAGE_BYTES), np.uint8), hints=PutHints(turn=1))
    lease = store.lease(request_digests(keys, None))
    try:
        (part,) = lease_parts(lease)
        assert part.sealed and pickle.loads(pickle.dumps(part)).sealed
    finally:
        store.release(lease)
