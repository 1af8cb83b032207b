"""Routing: a page's transport follows from its GVA's NodeID and MediaType bits alone."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flatcake_ray.core.gva import MAX_NODE_ID, MAX_OFFSET, Medium, encode
from flatcake_ray.errors import GVAError
from flatcake_ray.transports.base import (
    LOCAL_DRAM,
    LOCAL_SSD,
    OBJECT_STORE_FALLBACK,
    REMOTE_DRAM_NIXL,
    REMOTE_DRAM_RDMA,
    REMOTE_SSD_NVMEOF,
    REMOTE_SSD_SHIPPED,
)
from flatcake_ray.transports.routing import route, route_many

ALL_REMOTE = frozenset({REMOTE_DRAM_RDMA, REMOTE_DRAM_NIXL, REMOTE_SSD_NVMEOF, REMOTE_SSD_SHIPPED})
NOTHING = frozenset()
NIXL_ONLY = frozenset({REMOTE_DRAM_NIXL})

LOCAL = 3
OTHER = 7


@pytest.mark.parametrize(
    ("medium", "node", "available", "expected"),
    [
        (Medium.DRAM, LOCAL, NOTHING, LOCAL_DRAM),
        (Medium.DRAM, LOCAL, ALL_REMOTE, LOCAL_DRAM),
        (Medium.SSD, LOCAL, NOTHING, LOCAL_SSD),
        (Medium.SSD, LOCAL, ALL_REMOTE, LOCAL_SSD),
        (Medium.DRAM, OTHER, ALL_REMOTE, REMOTE_DRAM_RDMA),
        (Medium.DRAM, OTHER, NIXL_ONLY, REMOTE_DRAM_NIXL),
        (Medium.DRAM, OTHER, frozenset({REMOTE_DRAM_RDMA}), REMOTE_DRAM_RDMA),
        (Medium.DRAM, OTHER, NOTHING, OBJECT_STORE_FALLBACK),
        (Medium.DRAM, OTHER, frozenset({REMOTE_SSD_NVMEOF}), OBJECT_STORE_FALLBACK),
        (Medium.SSD, OTHER, ALL_REMOTE, REMOTE_SSD_NVMEOF),
        (Medium.SSD, OTHER, NIXL_ONLY, REMOTE_SSD_SHIPPED),
        (Medium.SSD, OTHER, frozenset({REMOTE_DRAM_RDMA}), OBJECT_STORE_FALLBACK),
        (Medium.SSD, OTHER, NOTHING, OBJECT_STORE_FALLBACK),
    ],
)
def test_route_table(medium, node, available, expected):
    assert route(encode(medium, node, 4096), LOCAL, available) == expected


def test_route_ignores_offset_bits():
    for offset in (0, 1, MAX_OFFSET):
        assert route(encode(Medium.DRAM, OTHER, offset), LOCAL, NIXL_ONLY) == REMOTE_DRAM_NIXL


def test_route_rejects_reserved_medium_and_bad_node():
    with pytest.raises(GVAError):
        route(2 << 60, LOCAL, NOTHING)
    with pytest.raises(GVAError):
        route(0, MAX_NODE_ID + 1, NOTHING)
    with pytest.raises(GVAError):
        route_many(np.array([2 << 60], dtype=np.uint64), LOCAL, NOTHING)
    with pytest.raises(GVAError):
        route_many(np.array([0]), -1, NOTHING)


def test_route_many_groups_a_mixed_request():
    gvas = np.array(
        [
            encode(Medium.DRAM, LOCAL, 0),
            encode(Medium.SSD, OTHER, 8192),
            encode(Medium.DRAM, OTHER, 4096),
            encode(Medium.SSD, LOCAL, 0),
            encode(Medium.DRAM, LOCAL, 4096),
        ],
        dtype=np.uint64,
    )
    groups = route_many(gvas, LOCAL, NIXL_ONLY)
    assert {k: v.tolist() for k, v in groups.items()} == {
        LOCAL_DRAM: [0, 4],
        REMOTE_SSD_SHIPPED: [1],
        REMOTE_DRAM_NIXL: [2],
        LOCAL_SSD: [3],
    }
    assert all(v.dtype == np.int64 for v in groups.values())


def test_route_many_merges_both_remote_media_into_the_fallback():
    gvas = [encode(Medium.SSD, OTHER, 0), encode(Medium.DRAM, OTHER, 0)]
    groups = route_many(gvas, LOCAL, NOTHING)
    assert list(groups) == [OBJECT_STORE_FALLBACK]
    assert groups[OBJECT_STORE_FALLBACK].tolist() == [0, 1]


def test_route_many_accepts_lists_with_values_numpy_would_turn_into_floats():
    # [2**63, 1] becomes float64 under np.asarray; the reserved medium must still be seen.
    with pytest.raises(GVAError):
        route_many([1 << 63, 1], LOCAL, NOTHING)
    with pytest.raises(GVAError):
        route_many([-1], LOCAL, NOTHING)
    with pytest.raises(GVAError):
        route_many(np.array([1.0]), LOCAL, NOTHING)
    assert route_many([], LOCAL, NOTHING) == {}


gva_parts = st.tuples(
    st.sampled_from([Medium.DRAM, Medium.SSD]),
    st.integers(0, MAX_NODE_ID),
    st.integers(0, MAX_OFFSET),
)
availability = st.frozensets(
    st.sampled_from(sorted(ALL_REMOTE | {OBJECT_STORE_FALLBACK, LOCAL_DRAM, LOCAL_SSD}))
)


@given(st.lists(gva_parts, max_size=64), st.integers(0, MAX_NODE_ID), availability)
def test_route_many_agrees_with_route(parts, local_node, available):
    gvas = np.array([encode(*p) for p in parts], dtype=np.uint64)
    groups = route_many(gvas, local_node, available)
    seen = np.concatenate([*groups.values(), np.empty(0, dtype=np.int64)])
    assert sorted(seen.tolist()) == list(range(len(parts)))  # a partition of the request
    for path, indices in groups.items():
        assert indices.size > 0
        assert np.all(np.diff(indices) > 0)
        for i in indices:
            assert route(int(gvas[i]), local_node, available) == path


@given(gva_parts, st.integers(0, MAX_NODE_ID), availability)
def test_route_depends_only_on_node_and_medium(part, local_node, available):
    medium, node, offset = part
    path = route(encode(medium, node, offset), local_node, available)
    assert path == route(encode(medium, node, 0), local_node, available)
    assert (path in (LOCAL_DRAM, LOCAL_SSD)) == (node == local_node)
    if node == local_node:
        assert path == (LOCAL_DRAM if medium is Medium.DRAM else LOCAL_SSD)
    else:
        assert path in available or path in (OBJECT_STORE_FALLBACK, REMOTE_SSD_SHIPPED)


@given(gva_parts, st.integers(0, MAX_NODE_ID), availability)
def test_remote_path_never_needs_an_unavailable_transport(part, local_node, available):
    medium, node, offset = part
    path = route(encode(medium, node, offset), local_node, available)
    if path == REMOTE_SSD_SHIPPED:
        assert REMOTE_DRAM_NIXL in available  # shipping rides on NIXL
    if medium is Medium.DRAM and node != local_node:
        assert path in (REMOTE_DRAM_RDMA, REMOTE_DRAM_NIXL, OBJECT_STORE_FALLBACK)
