import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flatcake_ray.core import gva
from flatcake_ray.errors import GVAError

media = st.sampled_from([gva.Medium.DRAM, gva.Medium.SSD])
nodes = st.integers(0, gva.MAX_NODE_ID)
offsets = st.integers(0, gva.MAX_OFFSET)


@given(media, nodes, offsets)
def test_round_trip(medium, node, offset):
    address = gva.encode(medium, node, offset)
    assert gva.decode(address) == (medium, node, offset)
    assert 0 <= address < 1 << 64


@given(media, nodes, offsets)
def test_medium_is_one_comparison(medium, node, offset):
    address = gva.encode(medium, node, offset)
    assert gva.is_ssd(address) == (medium is gva.Medium.SSD)
    assert (address < gva.SSD_FLOOR) == (medium is gva.Medium.DRAM)
    assert gva.node_of(address) == node


@given(st.lists(st.tuples(media, nodes, offsets), min_size=1, max_size=30))
def test_slowest_medium_is_max(fields):
    addresses = np.array([gva.encode(*f) for f in fields], dtype=np.uint64)
    expected = gva.Medium.SSD if any(f[0] is gva.Medium.SSD for f in fields) else gva.Medium.DRAM
    assert gva.slowest_medium(addresses) is expected


def test_field_layout_is_the_papers():
    assert gva.encode(gva.Medium.SSD, 0xABC, 0x123456789ABC) == 0x1ABC123456789ABC


@pytest.mark.parametrize(
    ("medium", "node", "offset"),
    [(2, 0, 0), (15, 0, 0), (-1, 0, 0), (0, 4096, 0), (0, -1, 0), (0, 0, 1 << 48), (0, 0, -1)],
)
def test_out_of_range_fields_are_typed_errors(medium, node, offset):
    with pytest.raises(GVAError):
        gva.encode(medium, node, offset)


@pytest.mark.parametrize("address", [-1, 1 << 64, 2 << 60, 15 << 60])
def test_malformed_gva_is_rejected(address):
    with pytest.raises(GVAError):
        gva.decode(address)
