"""The single-node store given bad input: typed errors, and nothing already stored is lost."""

from __future__ import annotations

import numpy as np
import pytest

from flatcake_ray.core.keys import PageKey
from flatcake_ray.errors import InvalidKeyError, MixedNamespaceError, ShapeError, StoreClosedError
from tests.conftest import LAYERS, PAGE_BYTES, random_kv
from tests.test_store import restore


# ---- bad input: typed errors, and nothing already stored is lost ------------------------
@pytest.fixture
def loaded(make_store):
    store = make_store()
    kv = random_kv(3, seed=13)
    store.put(["a", "b", "c"], kv)
    yield store, kv
    count, out = restore(store, ["a", "b", "c"])
    assert count == 3 and np.array_equal(out, kv)


@pytest.mark.parametrize(
    "bad_kv",
    [
        np.zeros((LAYERS + 1, 2, PAGE_BYTES), dtype=np.uint8),
        np.zeros((LAYERS, 3, PAGE_BYTES), dtype=np.uint8),
        np.zeros((LAYERS, 2, PAGE_BYTES + 1), dtype=np.uint8),
        np.zeros((LAYERS, 2, PAGE_BYTES), dtype=np.float32),
        np.zeros((LAYERS, 2 * PAGE_BYTES), dtype=np.uint8),
        np.zeros((LAYERS, PAGE_BYTES, 2), dtype=np.uint8).transpose(0, 2, 1),
        [[0]],
    ],
)
def test_bad_kv_shape_or_dtype(loaded, bad_kv):
    store, _ = loaded
    with pytest.raises(ShapeError):
        store.put(["n1", "n2"], bad_kv)
    assert store.exists(["n1"]) == 0


def test_bad_output_buffer(loaded):
    store, _ = loaded
    with pytest.raises(ShapeError):
        store.get(["a", "b", "c"], np.zeros((LAYERS, 2, PAGE_BYTES), dtype=np.uint8))
    read_only = np.zeros((LAYERS, 3, PAGE_BYTES), dtype=np.uint8)
    read_only.setflags(write=False)
    with pytest.raises(ShapeError):
        store.get(["a", "b", "c"], read_only)


@pytest.mark.parametrize("bad_key", [1.5, None, b"", "", True, ("a",)])
def test_bad_keys(loaded, bad_key):
    store, _ = loaded
    with pytest.raises(InvalidKeyError):
        store.put(["n1", bad_key], random_kv(2))
    with pytest.raises(InvalidKeyError):
        store.exists([bad_key])


def test_mixed_namespaces(loaded):
    store, _ = loaded
    keys = [PageKey("tenant-a", "k1"), PageKey("tenant-b", "k2")]
    with pytest.raises(MixedNamespaceError):
        store.put(keys, random_kv(2))
    with pytest.raises(MixedNamespaceError):
        store.exists([PageKey("tenant-a", "k1")], namespace="tenant-b")


def test_a_put_of_packed_keys_continues_its_packed_parent(loaded):
    """Keys packed by the caller (what a Ray client sends an owner) put as the keys would,
    and a packed parent continues its session; packed keys named with a namespace, or mixed
    with an unpacked parent either way round, are refused and store nothing."""
    from flatcake_ray.core.catalog import PutHints
    from flatcake_ray.core.keys import parent_digest, request_digests

    store, _ = loaded
    hints = PutHints(turn=2, prior_reply_tokens=1)
    assert store.put(["p1", "p2"], random_kv(2, seed=5), session_id="s-1", hints=hints)
    more = ["p3", "p4"]
    packed = request_digests(more, None)
    result = store.put(
        packed, random_kv(2, seed=6), parent=parent_digest(more, None, "p2"), hints=hints
    )
    assert (result.pages_written, result.session_id) == (2, "s-1")
    assert store.exists(more) == 2
    bad = [
        ({"namespace": "other"}, request_digests(["q1"], None)),
        ({"parent": "p4"}, request_digests(["q1"], None)),
        ({"parent": parent_digest(["q1"], None, "p4")}, ["q1"]),
    ]
    for options, keys in bad:
        with pytest.raises(InvalidKeyError):
            store.put(keys, random_kv(1, seed=7), **options)
    assert store.exists(["q1"]) == 0


def test_namespaces_isolate_tenants(loaded):
    store, _ = loaded
    assert store.exists(["a", "b", "c"], namespace="other") == 0
    store.put([PageKey("other", "a")], random_kv(1, seed=99))
    assert store.exists([PageKey("other", "a")]) == 1


def test_empty_put_and_bad_layer(loaded):
    store, _ = loaded
    with pytest.raises(ShapeError):
        store.put([], np.zeros((LAYERS, 0, PAGE_BYTES), dtype=np.uint8))
    handle = store.begin_put(["n"])
    with pytest.raises(ShapeError):
        handle.write_layer(LAYERS, random_kv(1)[0])
    handle.abort()


def test_closed_store(make_store):
    store = make_store()
    store.close()
    with pytest.raises(StoreClosedError):
        store.put(["a"], random_kv(1))
    with pytest.raises(StoreClosedError):
        store.exists(["a"])
