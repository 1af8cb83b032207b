"""Trace readers, Table 1 statistics, session inference and the trace CLI (the synthetic
generator is in ``test_traces_synth.py``)."""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from flatcake_ray.cli.trace import add_trace_commands
from flatcake_ray.errors import ConfigError, TraceFormatError
from flatcake_ray.traces.infer import infer_sessions, with_inferred_sessions
from flatcake_ray.traces.readers import iter_requests, load_trace, parse_line, write_generic
from flatcake_ray.traces.records import NO_VALUE, TraceRequest, frozen_blocks
from flatcake_ray.traces.stats import DistanceHistogram, compute_stats, reblock

DATA = Path(__file__).resolve().parent / "data"
SHARED_TRACE = (
    Path(__file__).resolve().parents[2]
    / "shared"
    / "traces"
    / "mooncake_conversation_trace.jsonl.gz"
)
FULL_SIZE_ENV = "FLATCAKE_FULL_TRACE_TESTS"


def shared_trace() -> Path:
    if not SHARED_TRACE.exists():
        reason = f"shared Mooncake trace not found at {SHARED_TRACE}"
        print(reason)
        pytest.skip(reason)
    return SHARED_TRACE


def within(value: float, target: float, tolerance: float) -> bool:
    return abs(value - target) <= tolerance * abs(target)


def request(blocks: list[int], t: float = 0.0, session: str | None = None) -> TraceRequest:
    return TraceRequest(t, session, None, frozen_blocks(blocks), 64 * len(blocks), 1, 64)


# --- readers ---------------------------------------------------------------------------


def test_mooncake_reader_on_real_lines() -> None:
    requests = list(iter_requests(DATA / "mooncake_sample.jsonl"))
    assert len(requests) == 7
    first = requests[0]
    assert first.arrival_s == 0.0 and first.session is None and first.turn is None
    assert first.block_tokens == 512 and first.input_tokens == 6758 and first.output_tokens == 500
    assert first.blocks.tolist() == list(range(14)) and not first.blocks.flags.writeable
    assert requests[3].arrival_s == 9.0 and requests[3].blocks.tolist() == [0, 820, 821]
    for r in requests:
        assert r.num_blocks == -(-r.input_tokens // 512)  # ceil(input / 512)


def test_bailian_reader_sessions_from_parent_chain() -> None:
    requests = list(iter_requests(DATA / "bailian_sample.jsonl"))
    assert [r.session for r in requests] == ["101", "102", "101", "101", "99"]
    assert [r.turn for r in requests] == [1, 1, 2, 3, 4]
    assert all(r.block_tokens == 16 for r in requests)
    assert requests[3].arrival_s == 7.75 and requests[3].blocks.tolist() == [7, 8, 9, 12, 13, 14]


def test_generic_reader_and_optional_fields() -> None:
    requests = list(iter_requests(DATA / "generic_sample.jsonl"))
    assert [r.session for r in requests] == ["alice", None, "alice", None]
    assert [r.turn for r in requests] == [1, None, 2, None]
    assert requests[2].blocks.tolist() == [1, 2, 4, 5, 6] and requests[2].input_tokens == 260


def test_generic_round_trip_and_gzip_by_magic(tmp_path: Path) -> None:
    original = list(iter_requests(DATA / "generic_sample.jsonl"))
    gz_path = tmp_path / "out.jsonl.gz"
    assert write_generic(gz_path, original) == 4
    assert gz_path.read_bytes()[:2] == b"\x1f\x8b"
    disguised = tmp_path / "no_gz_suffix.jsonl"  # gzip inside, plain name: still read
    shutil.copy(gz_path, disguised)
    plain = tmp_path / "plain.gz"  # plain text named .gz: still read as text
    write_generic(tmp_path / "plain.jsonl", original)
    shutil.copy(tmp_path / "plain.jsonl", plain)
    for path in (gz_path, disguised, plain):
        back = list(iter_requests(path))
        assert [
            (r.arrival_s, r.session, r.turn, r.input_tokens, r.output_tokens) for r in back
        ] == [(r.arrival_s, r.session, r.turn, r.input_tokens, r.output_tokens) for r in original]
        assert [r.blocks.tolist() for r in back] == [r.blocks.tolist() for r in original]


def test_mooncake_sample_gzipped_reads_the_same(tmp_path: Path) -> None:
    path = tmp_path / "sample.bin"
    path.write_bytes(gzip.compress((DATA / "mooncake_sample.jsonl").read_bytes()))
    assert [r.blocks.tolist() for r in iter_requests(path)] == [
        r.blocks.tolist() for r in iter_requests(DATA / "mooncake_sample.jsonl")
    ]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0, 1', "not JSON"),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": [0]}', "missing field"),
        ('{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [0]}', "integer"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0, "x"]}', "list"),
        ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": [0]}', ">= 0"),
        ("[1, 2, 3]", "JSON object"),
    ],
)
def test_malformed_line_raises_trace_format_error(
    tmp_path: Path, bad_line: str, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    good = (DATA / "mooncake_sample.jsonl").read_text().splitlines()[0]
    path.write_text(f"{good}\n\n{bad_line}\n")
    with pytest.raises(TraceFormatError, match=message) as caught:
        list(iter_requests(path))
    assert f"{path}:3" in str(caught.value)


def test_truncated_gzip_and_binary_files_raise_trace_format_error(tmp_path: Path) -> None:
    whole = gzip.compress((DATA / "mooncake_sample.jsonl").read_bytes())
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(whole[: len(whole) // 2])
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage\n")
    for path in (truncated, binary):
        with pytest.raises(TraceFormatError, match="unreadable"):
            list(iter_requests(path))


def test_unknown_first_line_format_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "odd.jsonl"
    path.write_text('{"when": 1, "what": []}\n')
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        list(iter_requests(path))
    with pytest.raises(TraceFormatError):
        parse_line('{"t": 0}', "nonsense")


def test_trace_columns_match_streamed_requests() -> None:
    trace = load_trace(DATA / "bailian_sample.jsonl")
    assert len(trace) == 5 and trace.block_ids.dtype == np.int32
    assert trace.session_names == ["101", "102", "99"]
    for column, streamed in zip(trace, iter_requests(DATA / "bailian_sample.jsonl"), strict=True):
        assert column.blocks.tolist() == streamed.blocks.tolist()
        assert (column.session, column.turn, column.arrival_s) == (
            streamed.session,
            streamed.turn,
            streamed.arrival_s,
        )
    generic = load_trace(DATA / "generic_sample.jsonl")
    assert generic.session_codes.tolist() == [0, NO_VALUE, 0, NO_VALUE]
    assert generic[-1].blocks.tolist() == [9, 10]


# --- statistics ------------------------------------------------------------------------


def test_stats_on_a_hand_computed_trace() -> None:
    # r0 [1 2 3]; r1 [1 2 4]: 1 and 2 at distance 1; r2 [5]; r3 [1 4]: both at distance 2.
    stats = compute_stats(
        [request([1, 2, 3], 0.0), request([1, 2, 4], 1.0), request([5], 2.0), request([1, 4], 4.0)]
    )
    assert (stats.requests, stats.unique_blocks, stats.block_accesses) == (4, 5, 9)
    assert stats.once_access_pct == pytest.approx(100 * 2 / 5)  # blocks 3 and 5
    assert stats.reuse_distance_mean == pytest.approx(1.5)
    assert stats.reuse_distance_intervening_mean == pytest.approx(0.5)
    assert stats.reuse_distance_p99 == pytest.approx(2.0)
    assert stats.hit_rate_pct == pytest.approx(100 * 4 / 9)
    assert stats.span_seconds == 4.0 and stats.mean_qps == 1.0
    assert stats.sessions_inferred


def test_repeated_block_in_one_request_is_one_access() -> None:
    stats = compute_stats([request([1, 2, 2, 1]), request([1])])
    assert (stats.block_accesses, stats.unique_blocks) == (3, 2)
    assert stats.hit_rate_pct == pytest.approx(100 / 3)


def test_large_and_negative_ids_give_the_same_stats_as_small_ones() -> None:
    rng = np.random.default_rng(3)
    small = [rng.integers(0, 50, size=rng.integers(1, 12)).tolist() for _ in range(300)]
    relabel = {v: (v * 7919 + 1) * (1 << 40) * (-1) ** v for v in range(50)}
    large = [[relabel[v] for v in blocks] for blocks in small]
    mixed = small[:150] + large[150:]  # switches from identity codes to the dict mid-stream
    base = compute_stats([request(b) for b in small]).to_dict()
    assert compute_stats([request(b) for b in large]).to_dict() == base
    combined = compute_stats([request(b) for b in mixed])
    assert combined.block_accesses == base["block_accesses"]
    assert combined.unique_blocks == len({v for blocks in mixed for v in blocks})
    assert (
        infer_sessions([request(b) for b in large]).session_of_request.tolist()
        == infer_sessions([request(b) for b in small]).session_of_request.tolist()
    )


def test_inference_survives_the_switch_to_dict_codes() -> None:
    # The huge id forces dict codes; blocks seen before the switch must stay known.
    trace = [request([0, 1, 2]), request([0, 7]), request([5 << 40]), request([0, 1, 2, 3])]
    inference = infer_sessions(trace, common_fanout=2)
    assert inference.session_of_request.tolist() == [0, 1, 2, 0]
    assert inference.turn_of_request.tolist() == [1, 1, 1, 2]


def test_histogram_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(11)
    values = rng.zipf(1.7, 5_000) % 10_000
    histogram = DistanceHistogram()
    for chunk in np.array_split(values, 17):
        histogram.add(chunk)
    for q in (0.0, 50.0, 90.0, 99.0, 99.9, 100.0):
        assert histogram.percentile(q) == pytest.approx(np.percentile(values, q))
    assert histogram.mean() == pytest.approx(values.mean())


def test_reblock_names_coarse_blocks_by_their_last_native_block() -> None:
    assert reblock(np.arange(7), 3).tolist() == [2, 5, 6]
    assert reblock(np.arange(6), 3).tolist() == [2, 5]
    assert reblock(np.arange(2), 1).tolist() == [0, 1]
    stats = compute_stats(iter_requests(DATA / "mooncake_sample.jsonl"), block_tokens=1024)
    assert stats.block_tokens == 1024
    for bad in (256, 700):
        with pytest.raises(ConfigError):
            compute_stats(iter_requests(DATA / "mooncake_sample.jsonl"), block_tokens=bad)


def test_table1_mooncake_conversation_row_is_reproduced() -> None:
    stats = compute_stats(iter_requests(shared_trace()))
    assert stats.requests == 12_031
    assert stats.unique_blocks == 182_790
    assert round(stats.once_access_pct, 1) == 75.8
    assert round(stats.reuse_distance_mean) == 728
    assert stats.reuse_distance_p99 == 5_527
    assert round(stats.hit_rate_pct, 2) == 36.64
    assert stats.sessions == 7_373 and stats.sessions_inferred
    assert stats.mean_blocks_per_request == pytest.approx(23.98, abs=0.01)
    assert stats.span_seconds == pytest.approx(3_537.0, abs=0.01)
    assert stats.mean_qps == pytest.approx(3.40, abs=0.01)


# --- session inference -----------------------------------------------------------------


def test_session_inference_on_sample_lines() -> None:
    # Real lines 1-3, 31, 67, 134 and 192: two two-turn conversations among first turns.
    inference = infer_sessions(iter_requests(DATA / "mooncake_sample.jsonl"), common_fanout=3)
    assert inference.session_of_request.tolist() == [0, 1, 2, 3, 4, 4, 3]
    assert inference.turn_of_request.tolist() == [1, 1, 1, 1, 1, 2, 2]


def test_session_inference_on_shared_trace_is_plausible_and_stable() -> None:
    trace = load_trace(shared_trace())
    counts = {fanout: infer_sessions(trace, fanout).sessions for fanout in (16, 32, 1000)}
    assert counts == {16: 7_373, 32: 7_373, 1000: 7_373}
    labelled = with_inferred_sessions(trace)
    turns = labelled.turns
    assert int((turns == 1).sum()) == 7_373 and int(turns.max()) == 43
    assert len(labelled.session_names) == 7_373
    # Every continuing request shares more than the system-prompt block with its session.
    assert compute_stats(labelled).sessions == 7_373


# --- command line ----------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flatcake-ray")
    add_trace_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_trace_stats_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["trace", "stats", str(DATA / "mooncake_sample.jsonl"), "--json"])
    assert args.handler(args) == 0
    row = json.loads(capsys.readouterr().out)
    required = {
        "requests", "unique_blocks", "once_access_pct", "reuse_distance_mean",
        "reuse_distance_p99", "hit_rate_pct", "sessions", "mean_blocks_per_request",
        "span_seconds", "mean_qps",
    }  # fmt: skip
    assert required <= row.keys() and row["requests"] == 7


def test_cli_trace_stats_reports_bad_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    args = parse(["trace", "stats", str(bad), str(DATA / "generic_sample.jsonl")])
    assert args.handler(args) == 1
    captured = capsys.readouterr()
    assert "not JSON" in captured.err and "requests" in captured.out


def test_cli_trace_synth_writes_gzip_generic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "agentic.jsonl.gz"
    argv = ["trace", "synth", "--profile", "agentic", "--seed", "1", "--out", str(out)]
    args = parse([*argv, "--scale", "0.01", "--qps", "2", "--stats", "--json"])
    assert args.handler(args) == 0
    row = json.loads(capsys.readouterr().out)
    assert row.pop("path") == "synth agentic x0.01"
    assert out.read_bytes()[:2] == b"\x1f\x8b"
    back = compute_stats(iter_requests(out))
    assert back.to_dict() == {**row, "span_seconds": back.span_seconds, "mean_qps": back.mean_qps}
    assert within(back.mean_qps, 2.0, 0.15)
    first = next(iter_requests(out))
    assert first.session is not None and first.turn == 1 and first.arrival_s == 0.0


def test_cli_trace_synth_stats_only_and_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["trace", "synth", "--profile", "mixed", "--scale", "0.02", "--stats"])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "synth mixed x0.02" in out and "once-access" in out
    args = parse(["trace", "synth", "--profile", "chat"])
    assert args.handler(args) == 2
    assert "--out" in capsys.readouterr().err
