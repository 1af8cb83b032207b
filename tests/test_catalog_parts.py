"""The catalog's parts, each alone on real allocation spaces: the scope table's age orders,
replicas, reclamation and allocation (the catalog as a whole is tested through the store)."""

from __future__ import annotations

import numpy as np
import pytest

from flatcake_ray.core.allocation import Allocation
from flatcake_ray.core.extents import MediumSpace
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.index import PageIndex, pack_location
from flatcake_ray.core.keys import key_digests
from flatcake_ray.core.layout import SegmentLayout
from flatcake_ray.core.reclamation import Reclamation
from flatcake_ray.core.records import Ids, Scope, Segment, Session
from flatcake_ray.core.replicas import Replicas
from flatcake_ray.core.scopes import ScopeTable
from flatcake_ray.core.usage import MediaUse
from tests.conftest import small_config

PAGE = 4096
LAYOUT = SegmentLayout(pages=4, layers=1, page_bytes=PAGE)  # 16 KiB a segment


class Parts:
    """One catalog's parts wired as the catalog wires them, over ``dram`` and ``ssd`` bytes."""

    def __init__(self, tmp_path, dram: int, ssd: int, quota: int | None = None) -> None:
        self.config = small_config(tmp_path, high_watermark=0.9, low_watermark=0.5)
        space = {Medium.DRAM: MediumSpace(dram, 1, PAGE), Medium.SSD: MediumSpace(ssd, 1, PAGE)}
        self.sessions: dict = {}
        self.segments: dict[int, Segment] = {}
        self.index = PageIndex()
        self.ids = Ids()
        self.freed: list[int] = []
        self.use = MediaUse(space, {Medium.DRAM: None, Medium.SSD: quota})
        self.scopes = ScopeTable(self.sessions)
        self.replicas = Replicas(
            self.config, space[Medium.DRAM], self.scopes, self.segments, self.ids
        )
        self.reclamation = Reclamation(
            self.use,
            self.scopes,
            self.segments,
            self.index,
            self.replicas,
            on_free=lambda scope: self.freed.append(scope.scope_id),
        )
        self.allocation = Allocation(self.config, self.use, self.scopes, self.reclamation, self.ids)

    def session(self, name: str) -> Session:
        return self.sessions.setdefault(name, Session(name))

    def written(self, session: str, medium: Medium, seed: int) -> Segment:
        """A segment allocated in ``session``'s scope and published into the index."""
        scope, offset = self.allocation.allocate(self.session(session), medium, LAYOUT.nbytes, True)
        assert scope is not None
        digests = key_digests([f"{seed}-{page}" for page in range(LAYOUT.pages)], None)
        segment = Segment(next(self.ids), scope.scope_id, medium, offset, LAYOUT, digests)
        self.segments[segment.segment_id] = segment
        scope.segments.append(segment.segment_id)
        values = pack_location(np.full(LAYOUT.pages, segment.segment_id), np.arange(LAYOUT.pages))
        scope.pages += int(self.index.insert(digests, values).sum())
        self.scopes.touch(scope, 0)
        return segment


def test_scope_table_orders_by_last_use_and_skips_pinned_scopes():
    sessions = {name: Session(name) for name in "abc"}
    table = ScopeTable(sessions)
    scopes = [Scope(i, name, Medium.SSD) for i, name in enumerate("abc", 1)]
    for scope in scopes:
        table.add(scope)
        sessions[scope.session_id].scopes[Medium.SSD] = scope.scope_id
    table.touch(scopes[0], 0)  # a is used: b is now the oldest
    assert table.oldest_unreferenced(Medium.SSD) is scopes[1]
    table.touch(scopes[1], +1)  # b is pinned: c goes first
    assert table.oldest_unreferenced(Medium.SSD) is scopes[2]
    assert table.oldest_unreferenced(Medium.DRAM) is None
    table.drop(scopes[2])
    assert 3 not in table and Medium.SSD not in sessions["c"].scopes


def test_replicas_take_free_dram_then_older_replicas_never_more(tmp_path):
    parts = Parts(tmp_path, dram=3 * LAYOUT.nbytes, ssd=1 << 20)
    homes = [parts.written(f"s{i}", Medium.SSD, i) for i in range(3)]
    planned = []
    for home in homes[:2]:  # two fit under the 90% high watermark of three segments' DRAM
        replica = parts.replicas.plan(parts.scopes[home.scope_id], home)
        assert replica is not None and replica.medium is Medium.DRAM
        parts.replicas.publish(replica, home)
        planned.append(replica)
    assert homes[0].replica is planned[0]
    third = parts.replicas.plan(parts.scopes[homes[2].scope_id], homes[2])
    assert third is not None and homes[0].replica is None  # the oldest replica made room
    assert parts.replicas.counters["replica_scopes_dropped"] == 1
    parts.scopes.touch(parts.scopes[planned[1].scope_id], +1)  # pinned while read
    fourth = parts.replicas.plan(parts.scopes[homes[0].scope_id], homes[0])
    assert fourth is None and parts.replicas.counters["replicas_refused"] == 1


def test_reclamation_frees_the_oldest_unreferenced_scope_whole(tmp_path):
    parts = Parts(tmp_path, dram=0, ssd=1 << 20)
    old, new = parts.written("old", Medium.SSD, 1), parts.written("new", Medium.SSD, 2)
    used = parts.use.used[Medium.SSD]
    scope = parts.reclamation.reclaim_oldest(Medium.SSD)
    assert scope is not None and scope.scope_id == old.scope_id
    assert parts.freed == [old.scope_id] and old.segment_id not in parts.segments
    assert parts.index.prefix_length(old.digests) == 0
    assert parts.index.prefix_length(new.digests) == LAYOUT.pages
    assert parts.use.used[Medium.SSD] == used - LAYOUT.nbytes
    assert parts.reclamation.counters["reclaimed_scopes"] == 1


def test_quarantine_forgets_the_keys_and_keeps_the_space(tmp_path):
    parts = Parts(tmp_path, dram=0, ssd=1 << 20)
    bad = parts.written("bad", Medium.SSD, 1)
    free_before = parts.use.space[Medium.SSD].free_bytes
    parts.reclamation.quarantine(bad.scope_id)
    assert parts.index.prefix_length(bad.digests) == 0 and bad.scope_id not in parts.scopes
    assert parts.use.space[Medium.SSD].free_bytes == free_before  # suspect media stays out
    assert parts.freed == [] and parts.reclamation.counters["quarantined_scopes"] == 1


def test_allocation_keeps_a_sessions_turns_contiguous(tmp_path):
    parts = Parts(tmp_path, dram=0, ssd=1 << 20)
    first = parts.written("chat", Medium.SSD, 1)
    second = parts.written("chat", Medium.SSD, 2)
    assert second.scope_id == first.scope_id
    assert second.offset == first.offset + LAYOUT.nbytes


def test_allocation_over_quota_reclaims_the_tenants_own_oldest_scope(tmp_path):
    parts = Parts(tmp_path, dram=0, ssd=1 << 20, quota=2 * LAYOUT.nbytes)
    first = parts.written("a", Medium.SSD, 1)
    parts.written("b", Medium.SSD, 2)
    parts.written("c", Medium.SSD, 3)  # over the quota: a goes
    assert parts.freed == [first.scope_id]
    assert parts.use.used[Medium.SSD] == 2 * LAYOUT.nbytes


def test_allocation_refuses_what_even_reclaiming_would_not_fit(tmp_path):
    parts = Parts(tmp_path, dram=0, ssd=2 * LAYOUT.nbytes)
    held = parts.written("held", Medium.SSD, 1)
    parts.scopes.touch(parts.scopes[held.scope_id], +1)  # leased
    big = 2 * LAYOUT.nbytes
    assert parts.allocation.allocate(parts.session("big"), Medium.SSD, big, False) == (None, 0)
    assert parts.freed == [] and held.segment_id in parts.segments  # nothing was evicted


@pytest.mark.parametrize("tail", [True, False])
def test_give_back_returns_an_unwritten_segment_only_at_its_runs_tail(tmp_path, tail):
    parts = Parts(tmp_path, dram=0, ssd=1 << 20)
    parts.written("s", Medium.SSD, 1)
    session = parts.session("s")
    scope, offset = parts.allocation.allocate(session, Medium.SSD, LAYOUT.nbytes, True)
    assert scope is not None
    scope.refs += 1  # the in-flight write's pin, as the catalog takes it
    unwritten = Segment(
        next(parts.ids), scope.scope_id, Medium.SSD, offset, LAYOUT, key_digests(["x"] * 4, None)
    )
    if not tail:
        later, _ = parts.allocation.allocate(session, Medium.SSD, LAYOUT.nbytes, True)
        assert later is scope
    used = parts.use.used[Medium.SSD]
    parts.allocation.give_back(unwritten)
    assert parts.use.used[Medium.SSD] == used - (LAYOUT.nbytes if tail else 0)
