"""DRAM read replicas (placement.py, ``dram_policy="replica"``): what the catalog grants and
drops, what the live store writes and reads, and invariants under random traffic."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatcake_ray.config import PlacementConfig, StoreConfig
from flatcake_ray.core.api import Probe
from flatcake_ray.core.catalog import Catalog, PutHints
from flatcake_ray.core.gva import Medium
from flatcake_ray.replay.pages import digests_of
from tests.conftest import random_kv

LAYERS, PAGE = 2, 4096
SEGMENT = LAYERS * PAGE  # bytes of one page of every layer


def config(dram_pages: int, policy: str = "replica", **changes) -> StoreConfig:
    base = dict(
        root="unused",
        layers=LAYERS,
        page_bytes=PAGE,
        dram_bytes=dram_pages * SEGMENT,
        ssd_file_bytes=1 << 20,
        ssd_files_per_dir=2,
        ssd_min_run_bytes=4096,
        high_watermark=1.0,
        low_watermark=1.0,
        placement=PlacementConfig(page_tokens=16, dram_policy=policy),
    )
    return StoreConfig(**{**base, **changes})


def put(catalog: Catalog, first: int, pages: int, session: str, **hints):
    plan = catalog.plan_put(
        digests_of(np.arange(first, first + pages)), session_id=session, hints=PutHints(**hints)
    )
    catalog.publish(plan)
    return plan


def read_media(catalog: Catalog, first: int, pages: int) -> list[Medium]:
    lease = catalog.lease(digests_of(np.arange(first, first + pages)))
    media = [lease.segments[int(s)].medium for s in lease.segment_ids]
    catalog.release(lease)
    return media


def test_an_ssd_put_gets_a_dram_replica_that_readers_are_handed():
    catalog = Catalog(config(dram_pages=16))
    plan = put(catalog, 0, 4, "a")  # a first turn: homed on SSD by Table 2
    assert plan.segment.medium is Medium.SSD and plan.rule == "one-shot"
    assert plan.replica is not None and plan.replica.medium is Medium.DRAM
    assert read_media(catalog, 0, 4) == [Medium.DRAM] * 4
    assert catalog.counters["replicas_written"] == 1


def test_table2_and_admit_write_no_replica():
    for policy in ("table2", "admit"):
        catalog = Catalog(config(dram_pages=16, policy=policy))
        plan = put(catalog, 0, 4, "a")
        assert plan.replica is None and read_media(catalog, 0, 4) == [Medium.SSD] * 4


def test_a_home_dram_scope_drops_replicas_and_replicas_never_drop_homes():
    catalog = Catalog(config(dram_pages=8))
    put(catalog, 0, 6, "agent")  # SSD home + a 6-page replica
    put(catalog, 100, 1, "chat")  # first turn: SSD home + 1-page replica (DRAM now full)
    chat = put(catalog, 101, 3, "chat", turn=2, prior_reply_tokens=10)  # short chat: DRAM home
    assert chat.segment.medium is Medium.DRAM and chat.rule == "short-chat"
    assert catalog.counters["replica_scopes_dropped"] >= 1
    assert read_media(catalog, 0, 6) == [Medium.SSD] * 6  # dropped, still a hit, from SSD
    home_bytes = chat.segment.layout.nbytes
    more = put(catalog, 200, 6, "other")  # no room left but the home: no replica, no loss
    assert more.replica is None and catalog.counters["replicas_refused"] >= 1
    assert read_media(catalog, 101, 3) == [Medium.DRAM] * 3
    assert catalog.space[Medium.DRAM].capacity - catalog.space[Medium.DRAM].free_bytes >= (
        home_bytes
    )


def test_replicas_are_dropped_least_recently_read_first_and_never_while_leased():
    catalog = Catalog(config(dram_pages=8))
    put(catalog, 0, 4, "a")
    put(catalog, 100, 4, "b")  # DRAM full of two replicas
    assert read_media(catalog, 0, 4) == [Medium.DRAM] * 4  # a is now the more recent
    held = catalog.lease(digests_of(np.arange(100, 104)))  # b is pinned by a reader
    put(catalog, 200, 4, "c")
    assert read_media(catalog, 0, 4) == [Medium.SSD] * 4  # a went: b was leased
    assert [held.segments[int(s)].medium for s in held.segment_ids] == [Medium.DRAM] * 4
    catalog.release(held)
    put(catalog, 300, 4, "d")  # now b (least recently read) goes, c stays
    assert read_media(catalog, 100, 4) == [Medium.SSD] * 4
    assert read_media(catalog, 200, 4) == [Medium.DRAM] * 4


def test_a_put_that_reuses_a_prefix_makes_its_replicas_recent():
    catalog = Catalog(config(dram_pages=8))
    put(catalog, 0, 4, "a")
    put(catalog, 100, 4, "b")  # DRAM full; a is the least recently used
    # a's next turn: its prefix came from the engine's own cache (no lease), yet it was used
    hints = PutHints(turn=2, prior_reply_tokens=5000)  # agentic: homed on SSD
    plan = catalog.plan_put(digests_of(np.arange(6)), session_id="a", hints=hints)
    catalog.publish(plan)
    assert plan.replica is not None
    assert read_media(catalog, 0, 4) == [Medium.DRAM] * 4
    assert read_media(catalog, 100, 4) == [Medium.SSD] * 4  # b made room


def test_reclaiming_an_ssd_scope_frees_its_replicas_and_abort_gives_space_back():
    catalog = Catalog(config(dram_pages=16))
    put(catalog, 0, 4, "a")
    used = catalog.space[Medium.DRAM].free_bytes
    ssd_scope = catalog.scopes[catalog.sessions["a"].scopes[Medium.SSD]]
    catalog.free_scope(ssd_scope)
    assert catalog.space[Medium.DRAM].free_bytes == catalog.space[Medium.DRAM].capacity > used
    assert not [s for s in catalog.scopes.values() if s.is_replica]
    plan = catalog.plan_put(digests_of(np.arange(50, 54)), session_id="b")
    assert plan.replica is not None
    catalog.abort(plan)
    assert catalog.space[Medium.DRAM].free_bytes == catalog.space[Medium.DRAM].capacity
    assert catalog.space[Medium.SSD].free_bytes == catalog.space[Medium.SSD].capacity


def test_a_bad_replica_is_dropped_and_its_pages_are_read_from_ssd():
    catalog = Catalog(config(dram_pages=16))
    put(catalog, 0, 4, "a")
    lease = catalog.lease(digests_of(np.arange(4)))
    replica_scope = next(iter(lease.segments.values())).scope_id
    catalog.release(lease)
    catalog.quarantine(replica_scope)
    assert read_media(catalog, 0, 4) == [Medium.SSD] * 4  # still hits: the SSD copy is good


def test_the_live_store_writes_both_copies_and_reads_the_replica(make_store):
    store = make_store(placement=PlacementConfig(page_tokens=16, dram_policy="replica"))
    kv = random_kv(6, seed=3)
    result = store.put(list(range(6)), kv)
    assert result.medium is Medium.SSD and store.stats()["replicas_written"] == 1
    # the probe says where a read goes (engines load DRAM hits inside the step), not the home
    assert store.probe(list(range(6))) == Probe(6, on_ssd=False)
    out = np.zeros_like(kv)
    assert store.get(list(range(6)), out) == 6 and (out == kv).all()
    stats = store.stats()
    assert stats["ssd_read_commands"] == 0 and stats["dram_bytes_read"] > 0
    for scope in [s for s in store.catalog.scopes.values() if s.is_replica]:
        store.catalog.free_scope(scope)  # drop the replica: the SSD copy serves the same bytes
    assert store.probe(list(range(6))) == Probe(6, on_ssd=True)
    out[:] = 0
    assert store.get(list(range(6)), out) == 6 and (out == kv).all()
    assert store.stats()["ssd_read_commands"] > 0


# ---- invariants under random traffic -----------------------------------------------------
OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "lease", "release", "abort", "reclaim"]),
        st.integers(0, 5),  # session
        st.integers(1, 6),  # pages
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(OPS, st.sampled_from([0, 3, 8, 20]))
def test_replica_bookkeeping_holds_under_random_traffic(ops, dram_pages):
    catalog = Catalog(config(dram_pages, high_watermark=0.9, low_watermark=0.6))
    next_key = itertools.count(0)
    heads: dict[int, list[int]] = {}
    leases = []
    for op, session, pages in ops:
        if op in ("put", "abort"):
            keys = heads.get(session, []) + [next(next_key) for _ in range(pages)]
            hints = PutHints(turn=len(keys) // 6 + 1, prior_reply_tokens=8)
            plan = catalog.plan_put(
                digests_of(np.array(keys)), session_id=f"s{session}", hints=hints
            )
            if plan is None:
                continue
            if op == "abort":
                catalog.abort(plan)
            else:
                catalog.publish(plan)
                heads[session] = keys
        elif op == "lease" and session in heads:
            leases.append(catalog.lease(digests_of(np.array(heads[session]))))
        elif op == "release" and leases:
            catalog.release(leases.pop(0))
        elif op == "reclaim":
            catalog.reclaim(Medium.DRAM, target=0.0)
    check_invariants(catalog, leases)


def check_invariants(catalog: Catalog, leases) -> None:
    dram = catalog.space[Medium.DRAM]
    dram_scopes = [s for s in catalog.scopes.values() if s.medium is Medium.DRAM]
    assert dram.capacity - dram.free_bytes == sum(s.runs.reserved_bytes for s in dram_scopes)
    runs = sorted((r.start, r.length) for s in dram_scopes for r in s.runs.runs)
    for (a, length), (b, _) in itertools.pairwise(runs):
        assert a + length <= b
    for segment in catalog.segments.values():
        if segment.replica is not None:
            replica_scope = catalog.scopes[segment.replica.scope_id]
            assert replica_scope.replica_of == segment.scope_id
            assert segment.medium is Medium.SSD and replica_scope.segments == [segment.segment_id]
            assert dataclasses.replace(segment.replica, medium=Medium.SSD).layout == segment.layout
    for lease in leases:  # what a reader holds is never taken from under it
        for view in lease.segments.values():
            assert view.scope_id in catalog.scopes
    for scope in catalog.scopes.values():
        assert scope.refs >= 0
        if scope.is_replica:
            assert scope.replica_of in catalog.scopes


def churn(policy: str) -> list[int]:
    """Sessions whose second turn Table 2 homes on SSD (long reply), among short chats that
    Table 2 homes on DRAM: how many of each session's 4 pages are still found."""
    catalog = Catalog(config(dram_pages=6, policy=policy, high_watermark=0.9, low_watermark=0.6))
    for session in range(6):
        put(catalog, session * 100, 3, f"s{session}")
        put(catalog, session * 100, 4, f"s{session}", turn=2, prior_reply_tokens=5000)
        put(catalog, 1000 + session * 10, 1, f"c{session}")
        put(catalog, 1000 + session * 10, 3, f"c{session}", turn=2, prior_reply_tokens=5)
    return [len(read_media(catalog, session * 100, 4)) for session in range(6)]


@pytest.mark.parametrize("policy", ["replica", "table2"])
def test_replicas_like_table2_never_lose_a_stored_page(policy):
    assert churn(policy) == [4] * 6  # every page has its SSD home


def test_admission_to_dram_loses_pages_when_dram_reclaims():
    assert min(churn("admit")) < 4  # admitted turns had no SSD copy
