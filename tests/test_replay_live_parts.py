"""The pieces of ``replay --live`` that need no cluster: arrivals with ties spread, one node's
share of a trace, dealing sessions to nodes, the live node's model profile, the table."""

from __future__ import annotations

import numpy as np
import pytest

from flatcake_ray.cli.replay_live import nodes_by_session
from flatcake_ray.cli.replay_live_compare import comparison, live_profile, markdown
from flatcake_ray.errors import ConfigError
from flatcake_ray.replay.pages import build_pages, select_requests
from flatcake_ray.replay.workloads import arrivals_for, spread_ties
from tests.test_replay_live import mixed_trace


def test_spread_ties_spreads_each_tick_over_the_gap_to_the_next():
    times = np.array([0.0, 0.0, 0.0, 3.0, 3.0, 6.0, 6.0, 6.0, 6.0])
    expected = [0.0, 1.0, 2.0, 3.0, 4.5, 6.0, 6.75, 7.5, 8.25]  # the last tick: the mean gap
    np.testing.assert_allclose(spread_ties(times), expected)


def test_spread_arrivals_keep_the_order_and_the_ticks():
    pages = build_pages(mixed_trace(), 16)
    spread = arrivals_for(pages, None, 0, "spread")
    assert (np.diff(spread) > 0).all()
    ticks = np.unique(pages.base_arrival)
    assert set(ticks) <= set(spread.tolist())  # each tick's first request keeps its time


def test_a_nodes_share_is_a_trace_of_its_own():
    pages = build_pages(mixed_trace(), 16)
    node_of = nodes_by_session(pages.sessions, 2)
    for slot in (0, 1):
        chosen = np.flatnonzero(node_of == slot)
        share = select_requests(pages, chosen)
        assert len(share) == len(chosen)
        for mine, theirs in enumerate(chosen):
            np.testing.assert_array_equal(share.digests_for(mine), pages.digests_for(theirs))
            assert share.session_of(mine) == pages.session_of(theirs)
        # Reuse is among the share's requests only, so never more than in the whole trace.
        assert (share.reusable <= pages.reusable[chosen]).all()


def test_sessions_are_dealt_to_nodes_round_robin_and_stay_together():
    sessions = np.array([5, 2, 5, 9, 2, -1, -1, 9])
    node_of = nodes_by_session(sessions, 2)
    assert node_of[[0, 2]].tolist() == [0, 0]  # session 5 came first
    assert node_of[[1, 4]].tolist() == [1, 1]
    assert node_of[[3, 7]].tolist() == [0, 0]
    assert node_of[[5, 6]].tolist() == [1, 0]  # no session: by index


def test_live_profile_has_the_nodes_geometry_and_no_hbm_or_compute():
    profile = live_profile("this-machine", 4, 4096, 256, restore_overhead_ms=2.0)
    assert (profile.page_bytes, profile.layers, profile.hbm_kv_bytes) == (4096, 4, 0)
    assert profile.prefill_seconds(100_000, 0) < 1e-6
    assert profile.restore_overhead_ms == 2.0
    with pytest.raises(ConfigError):
        live_profile("this-machine", 3, 4096, 1000)  # 12288 bytes do not split into tokens


def test_the_table_flags_what_is_out_of_bounds():
    pages = build_pages(mixed_trace(), 16)
    count = len(pages)

    def arrays(dram: int, ssd: int, commands: int, seconds: float) -> dict:
        out = {name: np.zeros(count) for name in ("dram_pages", "ssd_pages", "ssd_commands")}
        out["dram_pages"][:] = dram
        out["ssd_pages"][:] = ssd
        out["ssd_commands"][:] = commands
        for name in ("ssd_bytes", "restore_s", "ssd_seconds"):
            out[name] = np.full(count, seconds if name != "ssd_bytes" else 65536.0)
        return out

    live = arrays(2, 3, 1, 0.010)
    model = {**arrays(2, 3, 2, 0.004), "counters": {"ssd_read_bytes_restore": 65536 * count}}
    rows = {row["metric"]: row for row in comparison(pages, live, model, 4096)}
    assert rows["hit rate, DRAM"]["within"] and rows["hit rate, SSD"]["within"]
    assert rows["SSD read commands"]["relative_error"] == pytest.approx(-0.5)
    assert not rows["SSD read commands"]["within"]
    assert not rows["restore time P50 (s)"]["within"]  # 10 ms against 4 ms
    assert "| SSD read commands |" in markdown(list(rows.values()))
