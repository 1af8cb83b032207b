"""Page keys: the digested bytes frame (namespace, key) unambiguously."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flatcake_ray.core.keys import digest_keys
from flatcake_ray.errors import InvalidKeyError
from tests.conftest import random_kv


def test_a_nul_in_the_namespace_cannot_forge_another_namespaces_key():
    assert digest_keys("a", ["\0sX"]).tobytes() != digest_keys("a\0s", ["X"]).tobytes()
    assert digest_keys("a", [b"\0bX"]).tobytes() != digest_keys("a\0b", [b"X"]).tobytes()


def test_tenants_cannot_reach_each_other_through_the_framing(make_store):
    store = make_store()
    store.put(["\0sX"], random_kv(1), namespace="a")
    assert store.exists(["X"], namespace="a\0s") == 0
    assert store.exists(["\0sX"], namespace="a") == 1


@given(
    first=st.tuples(st.text(min_size=1, max_size=6), st.text(min_size=1, max_size=6)),
    second=st.tuples(st.text(min_size=1, max_size=6), st.text(min_size=1, max_size=6)),
)
def test_distinct_namespace_key_pairs_get_distinct_digests(first, second):
    same = (
        digest_keys(*first[:1], first[1:]).tobytes()
        == digest_keys(*second[:1], second[1:]).tobytes()
    )
    assert same == (first == second)


@pytest.mark.parametrize(("namespace", "key"), [("ok", "\ud800"), ("\udfff", "ok")])
def test_text_that_is_not_unicode_is_a_typed_error(namespace, key):
    with pytest.raises(InvalidKeyError):
        digest_keys(namespace, [key])


@given(st.lists(st.text(min_size=1), min_size=1, max_size=20), st.integers(0, 19))
def test_a_keys_digest_does_not_depend_on_the_other_keys_of_its_request(keys, at):
    # All-str requests take a faster path than mixed ones: both must give the same digests.
    mixed = [*keys[: at % len(keys)], b"bytes-key", *keys[at % len(keys) :]]
    text_only = digest_keys("tenant", keys)
    with_bytes = digest_keys("tenant", mixed)
    cut = at % len(keys)
    assert (text_only[:cut] == with_bytes[:cut]).all()
    assert (text_only[cut:] == with_bytes[cut + 1 :]).all()
    assert (digest_keys("tenant", tuple(keys)) == text_only).all()


@pytest.fixture(scope="module", params=[True, False], ids=["four-lanes", "one-lane"])
def native(request):
    """``core/_digests.c`` hashing four keys at once (AVX2, where the CPU has it) or one at
    a time: both must give hashlib's bytes."""
    from flatcake_ray.core import keys as module

    if module._native is None:
        pytest.skip("core/_digests.c is not built here (pip install compiles it)")
    previous = module._native.use_avx2(request.param)
    yield module._native
    module._native.use_avx2(previous)


@given(
    st.text(min_size=1, max_size=200),
    st.lists(
        st.text(min_size=1, max_size=300) | st.text(min_size=1, max_size=12),
        min_size=1,
        max_size=40,
    ),
)
def test_the_native_batch_digests_are_the_hashlib_digests(native, namespace, keys):
    """``core/_digests.c`` (when built) gives the bytes hashlib gives, for any text: keys
    and namespaces over a BLAKE2b block (128 bytes), multi-byte UTF-8, one-key requests,
    runs of four keys that fit one block mixed with keys that do not."""
    from hashlib import blake2b

    from flatcake_ray.core import keys as module

    try:
        prefix = module.namespace_frame(namespace) + b"s"
    except InvalidKeyError:  # a namespace that is not Unicode is refused before hashing
        return
    try:
        expected = b"".join(blake2b(prefix + k.encode(), digest_size=16).digest() for k in keys)
    except UnicodeEncodeError:  # a key that is not Unicode: the general path refuses it
        assert native.digest_str_keys(prefix, keys) is None
        return
    assert native.digest_str_keys(prefix, keys) == expected
    assert native.digest_str_keys(prefix, [*keys, 7]) is None


@pytest.mark.parametrize("namespace", ["", b"bytes", 7])
def test_a_namespace_that_is_not_a_non_empty_str_is_refused_on_every_path(namespace):
    """The client's packed request and the node's digests refuse it alike (an empty one
    never falls back to the default namespace)."""
    from flatcake_ray.core.keys import key_digests, request_digests

    for keys in (["a", "b"], [b"a", "b"]):
        with pytest.raises(InvalidKeyError):
            request_digests(keys, namespace)
        with pytest.raises(InvalidKeyError):
            key_digests(keys, namespace)


@pytest.mark.parametrize("extra", [-2, -1, 0, 1, 2, 129])
def test_native_digests_at_the_block_edge_are_the_hashlib_digests(native, extra):
    """A key whose prefix and bytes end just short of, on, or past one 128-byte block: the
    native path takes one block while they fit, the general update past it; four in a row
    (one compression of four lanes where all fit)."""
    from hashlib import blake2b

    from flatcake_ray.core import keys as module

    prefix = module.namespace_frame("edge") + b"s"
    key = "k" * (128 - len(prefix) + extra)
    expected = blake2b(prefix + key.encode(), digest_size=16).digest()
    assert native.digest_str_keys(prefix, [key, key]) == expected * 2
    short = blake2b(prefix + b"s", digest_size=16).digest()
    keys = [key, "s", "s", "s", "s", key, "s"]
    assert native.digest_str_keys(prefix, keys) == b"".join(
        expected if k == key else short for k in keys
    )
