"""Routing: a page's transport follows from its GVA's NodeID and MediaType bits alone."""

from __future__ import annotations

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
from flatcake_ray.transports.routing import route

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


gva_parts = st.tuples(
    st.sampled_from([Medium.DRAM, Medium.SSD]),
    st.integers(0, MAX_NODE_ID),
    st.integers(0, MAX_OFFSET),
)
availability = st.frozensets(
    st.sampled_from(sorted(ALL_REMOTE | {OBJECT_STORE_FALLBACK, LOCAL_DRAM, LOCAL_SSD}))
)


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
