"""What a put must be before anything is allocated, evicted or written: its session id (and
that the id survives a restart exactly), its page count, its size against its media."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatcake_ray.config import StoreConfig
from flatcake_ray.core.catalog import Catalog, PutHints
from flatcake_ray.core.keys import DIGEST_DTYPE
from flatcake_ray.errors import (
    InvalidSessionError,
    MediumFullError,
    PutTooLargeError,
    SegmentTooLargeError,
)
from flatcake_ray.node.store import FlatCakeStore
from tests.conftest import LAYERS, PAGE_BYTES, random_kv, small_config

SSD = PutHints(context_tokens=1 << 20)  # agentic: SSD
PAGE_SPAN = LAYERS * PAGE_BYTES  # bytes of one page of every layer


def readable(store: FlatCakeStore, keys: list, kv: np.ndarray) -> bool:
    out = np.zeros((LAYERS, len(keys), PAGE_BYTES), dtype=np.uint8)
    return store.get(keys, out) == len(keys) and bool(np.array_equal(out, kv))


# ---- session ids -----------------------------------------------------------------------------
class Named(str):
    pass


BAD = ["", b"", "\ud800", "x" * 1025, object()]  # empty, not Unicode, too long, not a type


@pytest.mark.parametrize(
    "session_id",
    [("chat", 7), ["chat"], 1.5, True, {"a": 1}, bytearray(b"x"), 1 << 64, -(1 << 63) - 1, *BAD],
    ids=lambda v: type(v).__name__,
)
def test_session_ids_other_than_str_int_bytes_are_refused_before_anything(make_store, session_id):
    store = make_store()
    with pytest.raises(InvalidSessionError):
        store.put(["a", "b"], random_kv(2), session_id=session_id, hints=SSD)
    assert store.exists(["a"]) == 0 and store.stats()["scopes"] == 0
    assert store.stats()["ssd_bytes_written"] == 0


def test_a_tuple_session_id_cannot_stop_a_restart(tmp_path):
    config = small_config(tmp_path)
    with FlatCakeStore(config) as store:
        with pytest.raises(InvalidSessionError):
            store.put(["t0"], random_kv(1), session_id=("chat", 1), hints=SSD)
        store.put(["s0"], random_kv(1), session_id="fine", hints=SSD)
    with FlatCakeStore(config) as store:
        assert store.exists(["s0"]) == 1


session_ids = st.one_of(
    st.text(min_size=1, max_size=40).filter(lambda t: len(t.encode("utf-8", "replace")) <= 1024),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.binary(min_size=1, max_size=40),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(session_id=session_ids)
def test_session_ids_round_trip_through_a_restart_exactly(tmp_path_factory, session_id):
    config = small_config(tmp_path_factory.mktemp("sessions"))
    first, second = random_kv(3, seed=1), random_kv(2, seed=2)
    with FlatCakeStore(config) as store:
        result = store.put(["p0", "p1", "p2"], first, session_id=session_id, hints=SSD)
        assert result.session_id == session_id and type(result.session_id) is type(session_id)
    with FlatCakeStore(config) as store:  # the restart replays the manifest
        assert store.stats()["scopes"] == 1
        keys = ["p0", "p1", "p2", "p3", "p4"]
        kv = np.concatenate([first, second], 1)
        result = store.put(keys, kv, session_id=session_id, hints=SSD)
        assert result.session_id == session_id and type(result.session_id) is type(session_id)
        assert store.stats()["scopes"] == 1  # the same id found the same scope again
        assert readable(store, keys, kv)


def test_session_ids_are_stored_as_their_plain_type(make_store):
    store = make_store()
    result = store.put(["a"], random_kv(1), session_id=Named("n"), hints=SSD)
    assert type(result.session_id) is str
    result = store.put(["b"], random_kv(1), session_id=np.int64(9), hints=SSD)
    assert type(result.session_id) is int and result.session_id == 9


# ---- the segment page cap --------------------------------------------------------------------
def test_a_put_of_more_pages_than_a_segment_addresses_is_refused_before_allocating():
    config = StoreConfig(
        root="unused", layers=1, page_bytes=1, dram_bytes=0, ssd_file_bytes=64 << 20
    )
    catalog = Catalog(config)
    free = catalog.space[next(iter(catalog.space))].free_bytes
    digests = np.zeros((1 << 24) + 1, dtype=DIGEST_DTYPE)  # calloc'd: costs no memory
    with pytest.raises(SegmentTooLargeError, match="at most 16777216"):
        catalog.plan_put(digests, hints=SSD)
    assert not catalog.scopes and catalog.space[next(iter(catalog.space))].free_bytes == free


# ---- oversize puts ---------------------------------------------------------------------------
def fill(store: FlatCakeStore, sessions: int, pages: int) -> dict[str, tuple[list, np.ndarray]]:
    written = {}
    for number in range(sessions):
        keys = [f"fill{number}/{i}" for i in range(pages)]
        kv = random_kv(pages, seed=number)
        store.put(keys, kv, session_id=f"fill{number}", hints=SSD)
        written[f"fill{number}"] = (keys, kv)
    return written


def test_a_put_larger_than_a_pool_file_is_refused_before_any_eviction(make_store):
    store = make_store()  # SSD: 2 files of 8 MiB; DRAM 4 MiB
    kept = fill(store, sessions=4, pages=40)
    pages = (8 << 20) // PAGE_SPAN + 1  # one page more than a pool file holds
    with pytest.raises(PutTooLargeError, match="split it"):
        store.put([f"big/{i}" for i in range(pages)], random_kv(pages), hints=SSD)
    assert store.stats()["reclaimed_scopes"] == 0
    assert all(readable(store, keys, kv) for keys, kv in kept.values())
    assert isinstance(PutTooLargeError("x"), MediumFullError)  # existing handlers still apply


def test_a_put_that_only_leased_space_could_hold_evicts_nothing(make_store):
    store = make_store()
    pinned = fill(store, sessions=2, pages=200)  # a 6.25 MiB run in each 8 MiB pool file
    leases = [store.lease(keys) for keys, _ in pinned.values()]
    loose_keys = [f"loose/{i}" for i in range(8)]
    loose_kv = random_kv(8, seed=99)
    store.put(loose_keys, loose_kv, session_id="loose", hints=SSD)
    pages = (3 << 20) // PAGE_SPAN  # 3 MiB: more than is free or freeable in either file
    with pytest.raises(MediumFullError, match="nothing was evicted"):
        store.put([f"big/{i}" for i in range(pages)], random_kv(pages), hints=SSD)
    assert store.stats()["reclaimed_scopes"] == 0 and readable(store, loose_keys, loose_kv)
    for lease in leases:
        store.release(lease)
    store.put([f"big/{i}" for i in range(pages)], random_kv(pages), hints=SSD)  # now it fits
