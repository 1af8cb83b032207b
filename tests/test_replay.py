"""The replay model: conservation laws, each baseline's defining behaviour, determinism,
outputs (its use of the live placement / catalog / coalescing / scheduler code is in
``test_replay_shared.py``)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from flatcake_ray.config import PlacementConfig
from flatcake_ray.errors import ConfigError
from flatcake_ray.replay import run_comparison, write_outputs
from flatcake_ray.replay.engine import Replay
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
