"""The SSD pages' cipher (``cuda_ext/host_seal.py``) against a reference AES-256-CTR."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatcake_ray.core.tenants import new_secret, seal_key
from flatcake_ray.cuda_ext.host_seal import available, ctr_rows
from flatcake_ray.errors import SealError, TenantError

cryptography = pytest.importorskip("cryptography")  # the reference (a test dependency)
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes  # noqa: E402

pytestmark = pytest.mark.skipif(not available(), reason="libcrypto does not load here")


def reference(key: bytes, plain: bytes, block_sum: int, into: int) -> bytes:
    """AES-256-CTR of ``plain`` lying ``into`` bytes into a block whose checksum is
    ``block_sum``: counter block = sum (8 bytes, big-endian) then ``into // 16``."""
    counter = block_sum.to_bytes(8, "big") + (into // 16).to_bytes(8, "big")
    stream = Cipher(algorithms.AES(key), modes.CTR(counter)).encryptor()
    return stream.update(bytes(into % 16) + plain)[into % 16 :]


@pytest.fixture(params=["native", "ctypes"])
def path(request, monkeypatch):
    """Both ways a batch is ciphered: the native row loop, and a ctypes call a row."""
    from flatcake_ray.cuda_ext import host_seal

    if request.param == "ctypes":
        monkeypatch.setattr(host_seal, "native_module", lambda: None)
    elif host_seal.native_module() is None:
        pytest.skip("cuda_ext/_copyhash is not built here")
    return request.param


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.lists(
        st.tuples(st.integers(1, 5000), st.integers(0, 2**64 - 1), st.integers(0, 1 << 20)),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_rows_seal_as_the_reference_and_unseal_back(path, rows, seed):
    key = seal_key(new_secret())
    lengths = np.array([n for n, _, _ in rows], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]) + 7  # rows back to back, odd start
    plain = np.random.default_rng(seed).integers(
        0, 256, int(offsets[-1] + lengths[-1] + 9), np.uint8
    )
    buffer = plain.copy()
    sums = np.array([s for _, s, _ in rows], dtype=np.uint64)
    into = np.array([i for _, _, i in rows], dtype=np.int64)
    ctr_rows(key, buffer, offsets, lengths, sums, into)
    for at, n, (_, block_sum, inside) in zip(offsets.tolist(), lengths.tolist(), rows, strict=True):
        expected = reference(key, plain[at : at + n].tobytes(), block_sum, inside)
        assert buffer[at : at + n].tobytes() == expected
    assert np.array_equal(buffer[:7], plain[:7])  # bytes outside the rows are untouched
    ctr_rows(key, buffer, offsets, lengths, sums, into)
    assert np.array_equal(buffer, plain)


def test_a_key_is_the_secrets_own():
    secret = new_secret()
    assert seal_key(secret) == seal_key(secret) != seal_key(new_secret())
    assert len(seal_key(secret)) == 32
    with pytest.raises(TenantError):
        seal_key("short")


def test_a_big_batch_splits_over_threads_and_matches_one_thread(monkeypatch):
    from flatcake_ray.cuda_ext import host_seal

    key = seal_key(new_secret())
    plain = np.random.default_rng(3).integers(0, 256, 16 << 20, dtype=np.uint8)
    offsets = np.arange(256, dtype=np.int64) * (64 << 10)
    lengths = np.full(256, 64 << 10, dtype=np.int64)
    sums = np.arange(256, dtype=np.uint64) * 0x9E3779B97F4A7C15
    split, alone = plain.copy(), plain.copy()
    monkeypatch.setattr(host_seal, "idle_threads", lambda: 2)
    ctr_rows(key, split, offsets, lengths, sums)
    monkeypatch.setattr(host_seal, "native_module", lambda: None)
    ctr_rows(key, alone, offsets, lengths, sums)
    assert np.array_equal(split, alone) and not np.array_equal(split, plain)


def test_bad_input_is_a_typed_error_and_touches_nothing():
    key = seal_key(new_secret())
    buffer = np.arange(64, dtype=np.uint8)
    kept = buffer.copy()
    with pytest.raises(SealError):
        ctr_rows(key[:16], buffer, np.array([0]), np.array([16]), np.array([1], np.uint64))
    with pytest.raises(SealError):
        ctr_rows(key, buffer, np.array([60]), np.array([16]), np.array([1], np.uint64))
    with pytest.raises(SealError):
        ctr_rows(key, buffer.view(np.int8), np.array([0]), np.array([16]), np.array([1], np.uint64))
    assert np.array_equal(buffer, kept)
