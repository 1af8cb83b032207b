"""When a benchmark run may be written into BENCHMARKS.md: pure functions, no timing.

``benchkit.unfit_for_record`` (shared by ``bench-peers``, ``bench-e2e`` and ``flatcake-ray
bench restore``), the peers harness's use of it on a result, the Mooncake bench's loopback
pinning, and the stage tool's figures (``benchmarks/stages.py``)."""

from __future__ import annotations

import argparse

from benchmarks.e2e_report import refusal as e2e_refusal
from benchmarks.peers import run as peers_run
from benchmarks.peers.sys_mooncake import LOOPBACK, MooncakeCluster
from benchmarks.peers.workload import Workload
from benchmarks.stage_clock import StageClock, medians, summarise
from flatcake_ray.cli.bench import refusal as restore_refusal
from flatcake_ray.cli.benchkit import MAX_START_LOAD, best_limits, unfit_for_record


def test_a_quiet_run_with_steady_limits_may_be_recorded() -> None:
    rows = {"restore local DRAM": {"memcpy": 10.0}, "put local DRAM": {"memcpy": 9.0}}
    assert unfit_for_record(1.0, rows, {"memcpy": 10.5, "odirect_read": 3.0}) == []


def test_a_run_that_started_above_the_load_bar_is_refused() -> None:
    reasons = unfit_for_record(MAX_START_LOAD + 0.01, {"row": {"memcpy": 10.0}})
    assert len(reasons) == 1 and "load average 1.51" in reasons[0]
    assert unfit_for_record(MAX_START_LOAD, {"row": {"memcpy": 10.0}}) == []


def test_a_limit_that_sagged_beside_a_row_names_the_row_and_the_limit() -> None:
    rows = {"restore local SSD": {"odirect_read": 2.3}, "put local SSD": {"odirect_read": 2.5}}
    reasons = unfit_for_record(0.5, rows, {"odirect_read": 3.0})
    assert len(reasons) == 1
    assert reasons[0].startswith("restore local SSD: odirect_read") and "23% below" in reasons[0]
    # exactly 20% below the best is still fit; a sag past it is not
    assert unfit_for_record(0.5, {"a": {"memcpy": 8.0}, "b": {"memcpy": 10.0}}) == []
    assert len(unfit_for_record(0.5, {"a": {"memcpy": 7.99}, "b": {"memcpy": 10.0}})) == 1


def test_the_best_of_a_limit_is_taken_over_rows_and_the_run() -> None:
    assert best_limits([{"memcpy": 4.0, "nixl": 1.0}, {"memcpy": 6.0}]) == {
        "memcpy": 6.0,
        "nixl": 1.0,
    }


def _peers_result(load: float, beside: float) -> dict:
    row = {"gbps": 1.0, "limits": {"memcpy": beside}}
    return {
        "config": {"load_before": load, "load_after": load},
        "limits": {
            "memcpy": 10.0,
            "odirect_read": 3.0,
            "odirect_write": 2.5,
            "nixl_default": 4.0,
            "nixl_tcp": 1.0,
            "tcp_loopback": 3.0,
        },
        "flatcake": {"restore": {"local DRAM": row}, "put": {"local DRAM": dict(row)}},
        "flatcake_tcp": {"restore": {}, "put": {}},
    }


def test_bench_peers_collects_every_rows_limits_and_refuses_a_sagged_run() -> None:
    result = _peers_result(0.8, 7.0)
    assert set(peers_run.row_limits(result)) == {
        "flatcake restore local DRAM",
        "flatcake put local DRAM",
    }
    assert len(peers_run.refusal(result)) == 2  # both rows: 30% under the run's 10.0
    assert peers_run.refusal(_peers_result(0.8, 9.5)) == []
    assert len(peers_run.refusal(_peers_result(3.0, 9.5))) == 1


def test_bench_peers_does_not_write_the_file_from_a_refused_run(tmp_path, capsys) -> None:
    target = tmp_path / "BENCHMARKS.md"
    target.write_text("untouched\n")
    args = argparse.Namespace(
        json=str(tmp_path / "peers.json"), md=str(tmp_path / "peers.md"), write_md=str(target)
    )
    result = _peers_result(4.0, 10.0)
    result["config"].update(
        command="x", pages=1, layers=1, page_bytes=64, bytes=64, rounds=1, scale_pages=1,
        clients=[1], versions={}, wall_seconds=1.0,
    )  # fmt: skip
    result["phase_seconds"] = {}
    assert peers_run._write(result, args)
    assert target.read_text() == "untouched\n"
    assert "NOT writing" in capsys.readouterr().err


def test_bench_restore_reports_why_its_figures_are_unfit() -> None:
    paths = {
        "local_dram": {"limit_gbps": 10.0},
        "remote_dram": {"limit_gbps": 4.0},
        "local_ssd": {"limit_gbps": 3.0},
        "remote_ssd": {"limit_gbps": 3.0},
    }
    assert restore_refusal({"config": {"load_before": 0.9}, "paths": paths}) == []
    reasons = restore_refusal({"config": {"load_before": 7.6}, "paths": paths})
    assert reasons == ["the run started at load average 7.60 (> 1.5)"]


def test_bench_e2e_refuses_a_busy_start_and_a_read_rate_that_sagged_beside_a_geometry() -> None:
    steady = {"tiny": 2.8, "wide": 2.5}
    assert e2e_refusal({"load_before": 0.9, "read_gbps": steady}) == []
    busy = e2e_refusal({"load_before": 1.77, "read_gbps": steady})
    assert len(busy) == 1 and "load average 1.77" in busy[0]
    sagged = e2e_refusal({"load_before": 0.9, "read_gbps": {"tiny": 2.8, "wide": 2.0}})
    assert len(sagged) == 1 and sagged[0].startswith("wide rows: odirect_read")


def test_mooncake_listens_and_connects_on_loopback_only(tmp_path) -> None:
    cluster = MooncakeCluster(Workload(pages=8), str(tmp_path), ssd=False, segment_bytes=1 << 20)
    assert cluster.env()["MC_TCP_BIND_ADDRESS"] == LOOPBACK == "127.0.0.1"


class _Timed:
    def work(self, value: int) -> int:
        return value + 1


def test_the_stage_clock_times_a_function_and_puts_it_back() -> None:
    clock = StageClock((("work", __name__, "_Timed.work"), ("gone", __name__, "_Missing.x")))
    original = _Timed.__dict__["work"]
    clock.install()
    rows: list[dict[str, float]] = []
    try:
        with clock.op(rows):
            assert _Timed().work(1) == 2
    finally:
        clock.uninstall()
    assert _Timed.__dict__["work"] is original
    assert set(rows[0]) == {"work", "wall"} and rows[0]["work"] <= rows[0]["wall"]


def test_stage_figures_are_medians_and_fractions_of_the_limit() -> None:
    rows = [{"wall": 100.0, "copy": 50.0}, {"wall": 200.0}, {"wall": 300.0, "copy": 10.0}]
    assert medians(rows) == {"copy": 10.0, "wall": 200.0}
    row = summarise(2_000_000_000, rows, [20.0, 10.0, 30.0])
    assert row["gbps"] == 10.0 and row["limit_gbps"] == 20.0 and row["fraction"] == 0.5


def test_a_bench_request_asked_for_dram_lands_in_dram(tmp_path) -> None:
    """A bench's arena is one chunk and its landing area holds a put's two layer slots: a
    service's 8 chunks of a bench-sized arena are each smaller than one bench request, whose
    DRAM puts then went to SSD (bench-peers' DRAM rows measured SSD)."""
    import numpy as np

    from flatcake_ray.cli.benchkit import bench_service_config
    from flatcake_ray.core.catalog import PutHints
    from flatcake_ray.core.gva import Medium
    from flatcake_ray.node.store import FlatCakeStore

    layers, pages, page_bytes = 4, 600, 16 << 10
    request = layers * pages * page_bytes  # 37.5 MiB
    service = bench_service_config(
        "hygiene", str(tmp_path), layers, page_bytes,
        dram_bytes=2 * request, ssd_bytes=2 * request, request_bytes=request,
    )  # fmt: skip
    assert service.landing_bytes >= 2 * pages * page_bytes
    kv = np.random.default_rng(3).integers(0, 256, (layers, pages, page_bytes), dtype=np.uint8)
    short_chat = PutHints(turn=2, prior_reply_tokens=1, context_tokens=1)
    with FlatCakeStore(service.store_config("0" * 16, 1)) as store:
        keys = [f"bench-{i}" for i in range(pages)]
        assert store.put(keys, kv, hints=short_chat).medium is Medium.DRAM
        out = np.zeros_like(kv)
        assert store.get(keys, out) == pages and np.array_equal(out, kv)


def test_a_bench_rewrites_its_section_and_keeps_the_notes_below_its_tables(tmp_path) -> None:
    from benchmarks.ssd_layout import GENERATED_END, replace_section

    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\n## A bench\n\nold table\n\n## Next\n\nother\n")
    replace_section(str(doc), "## A bench", "## A bench\n\ntable 1\n")
    doc.write_text(doc.read_text().replace(GENERATED_END + "\n", GENERATED_END + "\n\nnotes\n"))
    replace_section(str(doc), "## A bench", "## A bench\n\ntable 2\n")
    assert doc.read_text() == (
        f"# Benchmarks\n\n## A bench\n\ntable 2\n\n{GENERATED_END}\n\nnotes\n\n## Next\n\nother\n"
    )
    replace_section(str(doc), "## Missing", "## Missing\n\nnew\n")
    assert doc.read_text().endswith(f"other\n\n## Missing\n\nnew\n\n{GENERATED_END}\n")
