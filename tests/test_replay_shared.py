"""The replay model really uses the live code: the live catalog, placement policy, read plan
and scheduler drive it, and the live store still reads what the model's plans wrote."""

from __future__ import annotations

import numpy as np
import pytest

from flatcake_ray.config import PlacementConfig, StoreConfig
from flatcake_ray.core.catalog import Catalog
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.parts import lease_parts
from flatcake_ray.core.placement import PlacementPolicy
from flatcake_ray.core.plan import MediumAccess, RestorePlan
from flatcake_ray.replay import flat_store
from flatcake_ray.replay.flat_store import split_to_slots
from flatcake_ray.replay.pages import digests_of
from flatcake_ray.traces.records import Trace
from tests.test_replay import PAGE_TOKENS, replay, request, session_trace, tiny_profile


# ---- the shared code is really used -----------------------------------------------------
def test_flatcake_drives_the_live_catalog_policy_plan_and_scheduler(monkeypatch):
    calls = {"plans": 0}

    class CountingPlan(RestorePlan):
        def __init__(self, *args, **kwargs):
            calls["plans"] += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(flat_store, "RestorePlan", CountingPlan)
    engine, summary = replay(session_trace(), "flatcake")
    catalog = engine.storage.catalog
    assert isinstance(catalog, Catalog) and isinstance(catalog.policy, PlacementPolicy)
    storage = summary["storage"]
    assert sum(storage["catalog_rules"].values()) == storage["puts_published"] > 0
    assert storage["catalog_pages_indexed"] == len(catalog.index) > 0
    assert calls["plans"] == summary["scheduler"]["prefetches_started"] > 0
    scheduler = engine.scheduler.stats()
    assert (
        scheduler.dispatched_dram + scheduler.dispatched_ssd
        == len(engine.pages) + summary["counters"]["resubmitted"]
    )
    assert scheduler.max_inflight_prefetches_seen <= engine.profile.prefetch_windows


def test_a_request_sent_back_for_a_prefetch_reads_only_what_it_lacks():
    """Turn 3 arrives while turn 2 runs: it prefetches turn 1's pages from SSD; at dispatch
    turn 2's pages are stored too, so it goes back for a prefetch, which must read only
    those (its slots hold the rest). Pages of one checksum block each: every byte read is
    a byte delivered."""
    page = PAGE_TOKENS * 8192  # 2 layers x 64 KiB: one page per checksum block
    profile = tiny_profile(
        kv_bytes_per_token=8192,
        hbm_kv_bytes=2 * page,
        dram_bytes=16 * page,
        ssd_bytes=1 << 28,
        host_staging_bytes=12 * page,
        ssd_worker_gb_s=0.016,
        ssd_drive_gb_s=0.016,
        h2d_gb_s=0.16,
        prefill_tokens_per_s=1000.0,
        slot_bytes=4 << 20,
    )
    first = list(range(8))
    trace = Trace.from_requests(
        [
            request(0.0, "s", 1, first),
            request(5.0, "s", 2, [*first, 50, 51, 52, 53, *range(60, 100)]),
            request(5.001, "s", 3, [*first, 50, 51, 52, 53, 54]),
        ]
    )
    agentic = PlacementConfig(page_tokens=PAGE_TOKENS, l_agent_tokens=64)  # all on SSD
    _, summary = replay(trace, "flatcake-table2", profile=profile, placement=agentic)
    counters = summary["counters"]
    assert counters["resubmitted"] == 1
    assert counters["ssd_read_bytes_restore"] == counters["ssd_bytes_delivered"] > 0


def test_model_ssd_reads_are_the_live_pipelines_reads():
    """The model counts the read commands the live pipeline's chunks issue for a lease."""
    config = StoreConfig(
        root="unused",
        layers=3,
        page_bytes=4096,
        ssd_file_bytes=1 << 20,
        placement=PlacementConfig(dram_policy="table2"),  # SSD homes read from SSD
    )
    catalog = Catalog(config)
    keys = digests_of(np.arange(40))
    for stop in (10, 17, 40):
        plan = catalog.plan_put(keys[:stop], session_id="s")
        layout = plan.segment.layout
        plan.segment.checksums = np.zeros((layout.layers, layout.blocks), dtype=np.uint64)
        catalog.publish(plan)
    lease = catalog.lease(keys[:33])  # the last segment partly wanted
    parts = [p for p in lease_parts(lease) if p.medium.name == "SSD"]
    access = MediumAccess(False, True, config.ssd_file_bytes, 4096, config.gap_bytes)
    slot = 64 << 10
    plan = RestorePlan(parts, slot, {Medium.SSD: access})
    live = [r.length for g in plan.groups for c in plan.chunks(*g) for r in c.reads]
    modelled = [plan.reads(first, end, Medium.SSD).lengths for first, end in plan.groups]
    assert split_to_slots(np.concatenate(modelled), slot).sum() >= sum(live) > 0
    assert len(split_to_slots(np.concatenate(modelled), slot)) <= len(live) + len(plan.groups)
    wanted = 33 * 4096 * 3
    assert wanted <= sum(live) <= wanted + 3 * 4096  # whole blocks, one block slack a layer
    catalog.release(lease)


@pytest.mark.parametrize(("policy", "ssd_read"), [("table2", True), ("replica", False)])
def test_live_store_still_reads_what_it_wrote(tmp_path, policy, ssd_read):
    from flatcake_ray.node.store import FlatCakeStore

    config = StoreConfig(
        root=str(tmp_path),
        layers=3,
        page_bytes=4096,
        dram_bytes=1 << 20,
        ssd_file_bytes=8 << 20,
        ssd_files_per_dir=2,
        fsync=False,
        hugepages="off",
        placement=PlacementConfig(page_tokens=16, dram_policy=policy),
    )
    rng = np.random.default_rng(0)
    kv = rng.integers(0, 255, (3, 15, 4096), dtype=np.uint8)
    with FlatCakeStore(config) as store:
        store.put(list(range(10)), kv[:, :10])  # one-shot: SSD
        store.put(list(range(15)), kv)
        out = np.zeros_like(kv)
        assert store.get(list(range(15)), out) == 15
        assert (out == kv).all()
        # the first put is on SSD; with replicas its DRAM copy is what is read
        assert (store.stats()["ssd_read_commands"] > 0) == ssd_read
