"""The replay model: conservation laws, each baseline's defining behaviour, use of the live
placement / catalog / coalescing / scheduler code, determinism, outputs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from flatcake_ray.config import PlacementConfig, StoreConfig
from flatcake_ray.core.catalog import Catalog
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.parts import lease_parts
from flatcake_ray.core.placement import PlacementPolicy
from flatcake_ray.core.plan import MediumAccess, RestorePlan
from flatcake_ray.errors import ConfigError
from flatcake_ray.replay import flat_store, run_comparison, write_outputs
from flatcake_ray.replay.engine import Replay
from flatcake_ray.replay.flat_store import split_to_slots
from flatcake_ray.replay.metrics import summarize
from flatcake_ray.replay.pages import build_pages, digests_of
from flatcake_ray.replay.profiles import get_profile
from flatcake_ray.replay.sweep import run_one
from flatcake_ray.replay.systems import SYSTEMS, get_system
from flatcake_ray.replay.tiers import FifoBucketSsd, PageLru
from flatcake_ray.replay.workloads import arrivals_for, context_length_trace
from flatcake_ray.traces.records import Trace, TraceRequest, frozen_blocks

PAGE_TOKENS = 16
PAGE_ALL = 8192  # 2 layers x 4 KiB


def tiny_profile(**changes):
    """2 layers, 4 KiB per page-layer; capacities in pages of 8 KiB."""
    base = {
        "layers": 2,
        "kv_bytes_per_token": 512,
        "page_tokens": PAGE_TOKENS,
        "ranks": 1,
        "hbm_kv_bytes": 24 * PAGE_ALL,
        "dram_bytes": 16 * PAGE_ALL,
        "ssd_bytes": 1 << 22,
        "host_staging_bytes": 12 * PAGE_ALL,
        "ssd_worker_gb_s": 0.001,  # 1 MB/s: an 8-page restore takes ~65 ms
        "ssd_drive_gb_s": 0.001,
        "ssd_command_us": 100.0,
        "h2d_gb_s": 0.01,
        "prefill_tokens_per_s": 2000.0,
        "attention_pairs_per_s": 1e9,
        "prefill_overhead_ms": 1.0,
        "slot_bytes": 1 << 20,
    }
    return get_profile("this-machine", {**base, **changes})


def request(t, session, turn, blocks, output=8):
    return TraceRequest(
        t, session, turn, frozen_blocks(blocks), len(blocks) * PAGE_TOKENS, output, PAGE_TOKENS
    )


def session_trace(sessions=8, pages=8, gap=0.05, revisit_at=10.0):
    """Each session writes ``pages`` blocks, then all come back at once with 2 more."""
    requests = []
    for s in range(sessions):
        base = list(range(s * 100, s * 100 + pages))
        requests.append(request(s * gap, f"s{s}", 1, base))
    for s in range(sessions):
        base = list(range(s * 100, s * 100 + pages))
        requests.append(request(revisit_at + s * 0.001, f"s{s}", 2, [*base, 9000 + s, 9100 + s]))
    return Trace.from_requests(requests)


def replay(trace, system, profile=None, qps=None, seed=0, mode="scaled", placement=None):
    profile = profile or tiny_profile()
    pages = build_pages(trace, profile.page_tokens)
    engine = Replay(
        pages, arrivals_for(pages, qps, seed, mode), profile, get_system(system), placement
    )
    engine.run()
    return engine, summarize(engine, 0.0)


# ---- pages -------------------------------------------------------------------------------
def test_block_to_page_mapping_and_reuse():
    reqs = [
        TraceRequest(0.0, "a", 1, frozen_blocks([1, 2]), 1024, 10, 512),
        TraceRequest(1.0, "a", 2, frozen_blocks([1, 2, 3]), 1536, 10, 512),
        TraceRequest(2.0, "b", 1, frozen_blocks([1, 9]), 1024, 10, 512),
    ]
    trace = Trace.from_requests(reqs)
    small = build_pages(trace, 256)  # one 512-token block = two pages
    assert small.offsets.tolist() == [0, 4, 10, 14]
    assert small.reusable.tolist() == [0, 4, 2]
    assert small.prior_reply.tolist() == [-1, 10, -1]
    big = build_pages(trace, 1024)  # one page = two blocks, keyed by its last block
    assert big.offsets.tolist() == [0, 1, 2, 3]
    assert big.reusable.tolist() == [0, 1, 0]
    assert big.next_use.tolist() == [1, -1, -1]
    assert len(np.unique(digests_of(small.keys))) == len(np.unique(small.keys))


# ---- conservation ------------------------------------------------------------------------
@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_every_reusable_page_is_one_hit_or_a_miss(system):
    engine, summary = replay(session_trace(), system, qps=20.0, mode="jitter")
    records, pages = engine.records, engine.pages
    parts = np.stack([records.hbm, records.dram, records.ssd, records.miss])
    assert (parts >= 0).all() and (records.late >= 0).all()
    np.testing.assert_array_equal(parts.sum(axis=0), pages.reusable)
    shares = ("hit_rate_hbm", "hit_rate_dram", "hit_rate_ssd", "miss_rate")
    assert sum(summary[k] for k in shares) == pytest.approx(1.0)
    read = (
        summary["counters"]["ssd_read_bytes_restore"]
        + summary["counters"]["ssd_read_bytes_promotion"]
    )
    assert read >= summary["counters"]["ssd_bytes_delivered"]
    assert not np.isnan(records.done).any() and (records.done >= records.arrival).all()
    assert summary["storage"].get("leases_open", 0) == 0


# ---- baselines ---------------------------------------------------------------------------
def test_tiered_revokes_when_staging_is_exhausted_and_tuned_queues():
    trace = session_trace()
    tiered, revoked = replay(trace, "tiered")
    _, queued = replay(trace, "tiered-tuned", tiny_profile(host_staging_bytes=8 * PAGE_ALL))
    assert revoked["revoked_requests"] > 0
    assert tiered.records.miss[tiered.records.revoked].sum() > 0  # revoked pages recomputed
    assert tiered.staging.peak <= tiered.staging.capacity
    assert queued["revoked_requests"] == 0 and queued["counters"]["staging_queued"] > 0
    assert queued["hit_rate"] > revoked["hit_rate"]


def test_fifo_bucket_recycling_invalidates_another_sessions_prefix():
    ssd = FifoBucketSsd(capacity_bytes=4 * PAGE_ALL, buckets=2, object_bytes=PAGE_ALL)
    a, b, c = (digests_of(np.arange(n, n + 3)) for n in (0, 10, 20))
    ssd.append(a[:1], np.array([0]))  # session 0 shares bucket 0 with session 1
    ssd.append(b, np.array([1, 1, 1]))
    assert ssd.lookup(a[:1])[0].all() and ssd.lookup(b)[0].all()
    ssd.append(c[:1], np.array([2]))  # full: bucket 0 (session 0 and 1's head) is recycled
    assert not ssd.lookup(a[:1])[0].any()
    assert ssd.lookup(b)[0].tolist() == [False, True, True]  # session 1 lost its prefix head
    assert ssd.counters["cross_session_buckets"] == 1
    assert ssd.counters["pages_invalidated"] == 2


def test_tiered_ssd_recycles_buckets_across_sessions_in_a_replay():
    profile = tiny_profile(
        dram_bytes=4 * PAGE_ALL, ssd_bytes=24 * PAGE_ALL, hbm_kv_bytes=12 * PAGE_ALL
    )
    coarse = dataclasses.replace(SYSTEMS["tiered-gds"], fifo_buckets=4)  # 6 pages a bucket
    _, summary = replay(session_trace(sessions=10), coarse, profile)
    fifo = summary["storage"]
    assert fifo["fifo_buckets_recycled"] > 0 and fifo["fifo_cross_session_buckets"] > 0
    assert summary["miss_rate"] > 0


def test_flatcake_never_migrates_and_tiered_does():
    engine, summary = replay(session_trace(), "flatcake")
    storage = engine.storage
    assert summary["storage"].get("migrations", 0) == 0
    for segment_id, (medium, offset) in storage.media_at_publish.items():
        segment = storage.catalog.segments.get(segment_id)
        if segment is not None:
            assert (segment.medium, segment.offset) == (medium, offset)
    ssd_segments = sum(
        s.layout.nbytes for s in storage.catalog.segments.values() if s.medium.name == "SSD"
    )
    assert summary["counters"]["ssd_write_bytes"] == ssd_segments  # written once, nothing else
    assert summary["counters"]["ssd_read_bytes_promotion"] == 0
    _, tiered = replay(session_trace(), "tiered")
    assert tiered["storage"]["pages_demoted"] > 0 and tiered["storage"]["pages_promoted"] > 0


def test_fcfs_blocks_dram_hits_behind_ssd_restores():
    trace = session_trace(sessions=6, revisit_at=5.0)
    placement = PlacementConfig(page_tokens=PAGE_TOKENS, tau_tokens=4096, l_agent_tokens=1 << 20)
    _, fcmas = replay(trace, "flatcake", placement=placement)
    _, fcfs = replay(trace, "flatcake-fcfs", placement=placement)
    assert fcfs["scheduler"]["mean_wait_dram_s"] >= fcmas["scheduler"]["mean_wait_dram_s"]


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


# ---- determinism and outputs ------------------------------------------------------------
def test_runs_are_deterministic_per_seed():
    profile = tiny_profile()
    pages = build_pages(session_trace(), profile.page_tokens)

    def run(seed):
        summary = run_one(pages, profile, "tiered", qps=20.0, seed=seed)
        return {k: v for k, v in summary.items() if k != "wall_s"}

    assert run(1) == run(1)
    assert run(1)["ttft_mean_s"] != run(2)["ttft_mean_s"]


def test_lru_keeps_pins_and_evicts_tails_first():
    lru = PageLru(4)
    keys = digests_of(np.arange(6))
    lru.insert(keys[:4])
    _, slots = lru.slots(keys[:1])
    lru.pin(slots, +1)
    gone, _ = lru.insert(keys[4:6])
    assert set(gone["lo"].tolist()) == {3, 2}  # the tail of the first batch, not its head
    assert lru.prefix(keys) == 2 and len(lru) == 4


def test_comparison_writes_json_table_and_plots(tmp_path):
    trace = session_trace()
    result = run_comparison(
        trace,
        ("flatcake", "tiered"),
        tiny_profile(),
        qps=(10.0, 40.0),
        seeds=(0, 1),
        progress=False,
    )
    assert {(s["system"], s["x"]) for s in result["summary"]} == {
        (system, q) for system in ("flatcake", "tiered") for q in (10.0, 40.0)
    }
    paths = write_outputs(result, tmp_path)
    assert json.loads(paths["json"].read_text())["kind"] == "qps"
    table = paths["markdown"].read_text()
    assert table.count("\n") == 2 + 4 and "±" in table
    assert all(paths[name].stat().st_size > 1000 for name in ("overview", "hits_by_medium", "ssd"))


def test_cli_runs_a_replay(tmp_path, capsys):
    import argparse

    from flatcake_ray.cli.replay import add_replay_commands

    trace_path = tmp_path / "t.jsonl"
    from flatcake_ray.traces.readers import write_generic

    write_generic(trace_path, session_trace())
    parser = argparse.ArgumentParser()
    add_replay_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "replay",
            str(trace_path),
            "--systems",
            "flatcake,dram-only",
            "--no-progress",
            "--set",
            "ssd_bytes=64MiB",
            "--out",
            str(tmp_path / "out"),
            "--qps",
            "5",
        ]
    )
    assert args.handler(args) == 0
    assert "| flatcake |" in capsys.readouterr().out
    assert (tmp_path / "out" / "overview.png").exists()
    from flatcake_ray.cli import main

    assert main(["replay", str(trace_path), "--set", "nonsense=1", "--no-progress"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("flatcake-ray: error: unknown profile field")


def test_configuration_errors_are_typed():
    with pytest.raises(ConfigError):
        get_profile("no-such-profile")
    with pytest.raises(ConfigError):
        get_system("no-such-system")
    with pytest.raises(ConfigError):
        tiny_profile(layers=0)
    with pytest.raises(ConfigError):
        context_length_trace(100, sessions=2, new_tokens=512)


@pytest.mark.parametrize("hold", [True, False])
def test_a_turn_queued_behind_its_predecessor_reads_nothing_the_predecessor_brings(hold):
    """Turn 3 arrives while turn 2 of its session still prefetches the session's prefix from
    SSD. With the scheduler's shared-prefix hold it waits for turn 2's prefill and finds the
    prefix in HBM: nothing is read twice. Without it both read the prefix, and turn 3 finds
    in HBM what it read (read, never delivered)."""
    first = list(range(8))
    trace = Trace.from_requests(
        [
            request(0.0, "a", 1, first),
            request(1.0, "b", 1, list(range(500, 520))),  # pushes a's pages out of HBM
            request(5.0, "a", 2, [*first, 50, 51]),
            request(5.001, "a", 3, [*first, 50, 51, 52]),
        ]
    )
    agentic = PlacementConfig(page_tokens=PAGE_TOKENS, l_agent_tokens=64)  # all on SSD
    spec = dataclasses.replace(SYSTEMS["flatcake-table2"], hold_shared_prefixes=hold)
    engine, summary = replay(trace, spec, placement=agentic)
    counters = summary["counters"]
    assert counters["ssd_bytes_delivered"] > 0
    if hold:
        assert counters["ssd_read_bytes_hbm_covered"] == 0
        assert engine.scheduler.stats().holds == 1
        assert engine.records.hbm[3] >= len(first)  # the prefix came from turn 2's prefill
    else:
        assert counters["ssd_read_bytes_hbm_covered"] > 0
