"""The signed tenant table's decoder, fuzzed: unsigned or signed garbage raises tenant errors
only, and a real table round-trips."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flatcake_ray.actors.auth import decode_table, encode_table
from flatcake_ray.core.tenants import Tenant, secret_hash
from flatcake_ray.errors import AccessDeniedError, TenantError
from tests.test_fuzz_actors import FUZZ, _packable

# ---- the signed tenant table's decoder -----------------------------------------------------------
TABLE_SECRET = "s" * 64


@FUZZ
@given(raw=st.binary(max_size=256))
def test_the_table_decoder_refuses_unsigned_garbage(raw):
    with pytest.raises(AccessDeniedError):
        decode_table(raw, TABLE_SECRET)


_records = st.recursive(
    _packable,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=20,
)


@FUZZ
@given(
    body=st.one_of(
        st.binary(max_size=128),
        _records.map(lambda value: msgpack.packb(value, use_bin_type=True)),
        st.builds(
            lambda tenants: msgpack.packb({"format": 1, "tenants": tenants}, use_bin_type=True),
            _records,
        ),
    )
)
def test_the_table_decoder_fed_signed_garbage_raises_tenant_errors_only(body):
    from flatcake_ray.actors.auth import Gate, _tag

    try:
        tenants = decode_table(_tag(TABLE_SECRET, body) + body, TABLE_SECRET)
    except TenantError:
        return
    assert all(isinstance(t, Tenant) for t in tenants.values())
    Gate("fuzz", TABLE_SECRET, None, in_gcs=False).adopt(tenants)  # usable as decoded


def test_the_table_decoder_round_trips_a_real_table():
    tenants = {"a": Tenant("a", secret_hash("x" * 32), 2, 4096, quota_dram=1 << 20)}
    assert decode_table(encode_table(tenants, TABLE_SECRET), TABLE_SECRET) == tenants
