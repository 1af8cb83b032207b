import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatcake_ray.core.index import PageIndex, pack_location, unpack_location
from flatcake_ray.core.keys import digest_keys


def test_insert_lookup_delete():
    index = PageIndex(capacity=16)
    digests = digest_keys("ns", range(1000))  # forces several rehashes
    inserted = index.insert(digests, np.arange(1000))
    assert inserted.all() and len(index) == 1000
    found, values = index.lookup(digests)
    assert found.all() and (values == np.arange(1000)).all()
    assert index.delete(digests[:10]) == 10
    assert index.prefix_length(digests) == 0
    assert index.prefix_length(digests[10:]) == 990


def test_write_once_keeps_first_value():
    index = PageIndex()
    digests = digest_keys("ns", [1, 2, 2, 3])
    inserted = index.insert(digests, np.array([10, 20, 21, 30]))
    assert inserted.tolist() == [True, True, False, True]
    assert not index.insert(digests[:1], np.array([99])).any()
    assert index.lookup(digests)[1].tolist() == [10, 20, 20, 30]


def test_namespaces_and_key_types_are_distinct():
    digests = np.concatenate([digest_keys("a", [1, "1", b"1"]), digest_keys("b", [1])])
    assert len(np.unique(digests.view(np.void))) == 4


def test_bytes_per_page_stays_small():
    index = PageIndex()
    count = 200_000
    index.insert(digest_keys("ns", range(count)), np.arange(count))
    assert index.nbytes / count < 80  # 24 bytes a slot at load <= 0.7


def test_location_packing():
    segments, pages = np.array([1, 2**30]), np.array([0, 2**24 - 1])
    assert [a.tolist() for a in unpack_location(pack_location(segments, pages))] == [
        segments.tolist(),
        pages.tolist(),
    ]


@pytest.fixture(params=["native", "numpy"])
def probes(request):
    """The index with ``core/_digests.c``'s probe and insert (built by pip install), and with
    the numpy fallback."""
    from unittest import mock

    from flatcake_ray.core import index as index_module
    from flatcake_ray.core.keys import native_module

    if request.param == "numpy":
        with mock.patch.object(index_module, "native_module", return_value=None):
            yield request.param
    elif native_module() is None:
        pytest.skip("core/_digests.c is not built here (pip install -e . builds it)")
    else:
        yield request.param


@settings(
    max_examples=60,
    deadline=None,
    # the fixture's choice of probe holds for every example: meant to be shared
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 300), min_size=1, max_size=6)),
        max_size=120,
    )
)
def test_matches_a_dict_model(probes, operations):
    """Batches with repeats, over deleted slots and rehashes: write-once, first value kept."""
    index, model = PageIndex(capacity=16), {}
    for insert, keys in operations:
        digests = digest_keys("ns", keys)
        if insert:
            inserted = index.insert(digests, np.array(keys) + 7 * np.arange(1, len(keys) + 1))
            expected = []
            for position, key in enumerate(keys):
                expected.append(key not in model)
                model.setdefault(key, key + 7 * (position + 1))
            assert inserted.tolist() == expected
        else:
            index.delete(digests)
            for key in keys:
                model.pop(key, None)
    keys = list(range(301))
    found, values = index.lookup(digest_keys("ns", keys))
    assert found.tolist() == [k in model for k in keys]
    assert [int(v) for v, f in zip(values, found, strict=True) if f] == [
        model[k] for k in sorted(model)
    ]
    assert len(index) == len(model)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 400), max_size=150),
    st.lists(st.integers(0, 400), max_size=60),
)
def test_the_native_probe_and_numpy_find_the_same_pages(kept, deleted):
    """``core/_digests.c``'s probe (built by pip install) and the numpy fallback answer every
    lookup alike, over long probe chains and deleted slots (a small, full table)."""
    from unittest import mock

    from flatcake_ray.core import index as index_module
    from flatcake_ray.core.keys import native_module

    if native_module() is None:
        pytest.skip("core/_digests.c is not built here (pip install -e . builds it)")
    index = PageIndex(capacity=16)
    index.insert(digest_keys("ns", kept), np.array(kept) + 3)
    index.delete(digest_keys("ns", deleted))
    probe = digest_keys("ns", range(401))
    native = index.lookup(probe)
    with mock.patch.object(index_module, "native_module", return_value=None):
        fallback = index.lookup(probe)
    assert np.array_equal(native[0], fallback[0]) and np.array_equal(native[1], fallback[1])
    assert native[0].tolist() == [k in set(kept) - set(deleted) for k in range(401)]


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    st.lists(st.integers(0, 15), min_size=1, max_size=11),
    st.lists(st.integers(0, 10), max_size=11),
)
def test_colliding_chains_across_the_tables_end(probes, homes, deleted):
    """Digests made to share home slots near the end of a 16-slot table (their chains wrap to
    its start): after deletes in any order, every other digest is still found, with its
    value, and a deleted one is not (the native delete shifts chains back, numpy marks)."""
    from flatcake_ray.core.keys import DIGEST_DTYPE, HI_MARK

    digests = np.zeros(len(homes), dtype=DIGEST_DTYPE)
    digests["hi"] = HI_MARK | (np.array(homes, dtype=np.uint64) + np.uint64(16))
    digests["lo"] = np.arange(2, len(homes) + 2, dtype=np.uint64)  # distinct, never 0 or 1
    index = PageIndex(capacity=16)
    assert index.insert(digests, np.arange(len(homes)) + 100).all()
    gone = sorted({d for d in deleted if d < len(homes)})
    for position in deleted:  # one at a time, repeats included: each shifts the table
        if position < len(homes):
            index.delete(digests[position : position + 1])
    found, values = index.lookup(digests)
    assert found.tolist() == [p not in gone for p in range(len(homes))]
    assert values[found].tolist() == [p + 100 for p in range(len(homes)) if p not in gone]
    assert len(index) == len(homes) - len(gone)
