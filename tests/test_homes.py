"""Chain homes: the rendezvous ranking (``core/homes.py``) and a node's home directory, kept
across a restart in its log (``actors/homes.py``). The lookups through homes on a live
cluster are in test_lookup_scale.py."""

from __future__ import annotations

from hashlib import blake2b

import pytest

from flatcake_ray.actors.homes import HomeDirectory
from flatcake_ray.core.homes import (
    HOME_DEPTH,
    HOME_REPLICAS,
    anchor_of,
    home_candidates,
    home_node,
    recorded_pages,
)
from flatcake_ray.core.keys import request_digests
from flatcake_ray.errors import ShapeError


def first(i: int) -> bytes:
    return blake2b(str(i).encode(), digest_size=16).digest()


def test_a_join_or_a_leave_keeps_one_of_the_two_homes_of_every_chain():
    nodes = list(range(1, 17))
    for i in range(2000):
        homes = home_candidates(first(i), nodes)
        assert len(homes) == HOME_REPLICAS and homes[0] == home_node(first(i), nodes)
        joined = home_candidates(first(i), [*nodes, 99])
        left = home_candidates(first(i), [n for n in nodes if n != homes[0]])
        assert set(homes) & set(joined) and set(homes) & set(left)


def test_a_join_moves_about_one_chain_in_n():
    nodes = list(range(1, 9))
    moved = sum(home_node(first(i), nodes) != home_node(first(i), [*nodes, 9]) for i in range(9000))
    assert 700 < moved < 1300  # 1/9 of 9,000 is 1,000


def test_chains_sharing_their_first_page_have_their_homes_spread():
    nodes = list(range(1, 9))
    chains = [request_digests(["system", f"user-{i}", f"reply-{i}"], None) for i in range(64)]
    assert len({home_node(chain[:1].tobytes(), nodes) for chain in chains}) == 1
    assert len({home_node(anchor_of(chain), nodes) for chain in chains}) == len(nodes)


def test_a_chain_is_recorded_at_the_anchor_its_lookups_ask_whatever_its_puts():
    keys = [f"k{i}" for i in range(12)]
    for head in range(1, 6):  # a first put of `head` pages, then continuations of 3
        recorded = {
            request_digests(keys[:head], None)[p].tobytes() for p in recorded_pages(head, False)
        }
        for start in range(head, len(keys), 3):
            put = request_digests(keys[start : start + 3], None)
            recorded |= {put[p].tobytes() for p in recorded_pages(len(put), True)}
        for pages in range(1, len(keys) + 1):  # every prefix a lookup may ask for
            asked = anchor_of(request_digests(keys[:pages], None))
            assert asked in recorded or (pages < HOME_DEPTH and pages != head), (head, pages)
    assert recorded_pages(1, False) == [0] and recorded_pages(1, True) == [0]


def test_records_survive_a_restart_and_a_torn_last_record(tmp_path):
    path = tmp_path / "homes.log"
    homes = HomeDirectory(path)
    for i in range(10):
        homes.record("t", first(i), i)
    homes.record("t", first(3), 42)  # the chain moved: the later record wins
    homes.record("u", first(0), 7)
    homes.close()
    with open(path, "ab") as log:
        log.write(b"\x05\x00\x09")  # a record cut short by a crash
    again = HomeDirectory(path)
    assert again.owner("t", first(3)) == 42 and again.owner("t", first(9)) == 9
    assert again.owner("u", first(0)) == 7 and again.owner("u", first(1)) is None
    assert len(again) == 11
    again.drop_tenant("t")
    again.close()
    reread = HomeDirectory(path)
    assert len(reread) == 1
    reread.close()


def test_the_log_is_rewritten_when_it_outgrows_the_records(tmp_path):
    path = tmp_path / "homes.log"
    homes = HomeDirectory(path, max_chains=4)
    for i in range(3000):
        homes.record("t", first(i % 8), i)
    homes.close()
    assert path.stat().st_size < 2000 * 30
    kept = HomeDirectory(path, max_chains=4)
    assert len(kept) == 4 and kept.owner("t", first(7)) == 2999
    kept.close()


def test_a_chain_is_named_by_a_16_byte_digest():
    from flatcake_ray.actors.homes import check_first

    with pytest.raises(ShapeError):
        check_first(b"short")
