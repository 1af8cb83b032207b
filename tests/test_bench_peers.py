"""The peers benchmark's pure pieces: byte checks, Mooncake's bucket size, limits per cell, and
the Markdown it writes into BENCHMARKS.md. (The systems themselves run in `make bench-peers`.)"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.peers.report import END, START, limit_of, markdown, write_section
from benchmarks.peers.sys_mooncake import MAX_BUCKET_KEYS, bucket_keys
from benchmarks.peers.workload import ByteMismatch, Workload, check_bytes

LIMITS = {
    "memcpy": 10.0,
    "odirect_read": 2.0,
    "odirect_write": 1.5,
    "nixl_default": 4.0,
    "nixl_tcp": 1.0,
    "tcp_loopback": 3.0,
}


@given(st.integers(1, 20_000))
def test_bucket_keys_divide_the_session_and_fit_one_write(pages: int) -> None:
    keys = bucket_keys(pages)
    assert pages % keys == 0
    assert 1 <= keys <= MAX_BUCKET_KEYS
    assert all(pages % d for d in range(keys + 1, min(pages, MAX_BUCKET_KEYS) + 1))


def test_the_default_session_is_eleven_buckets() -> None:
    assert bucket_keys(3421) == 311


def test_workload_bytes_are_the_same_for_a_seed_and_checked_exactly() -> None:
    workload = Workload(pages=8, layers=2, page_bytes=1024, rounds=1)
    first, again = workload.kv(5), workload.kv(5)
    assert first.shape == (2, 8, 1024)
    check_bytes(again, first, "same seed")
    again[1, 7, 1023] ^= 1
    with pytest.raises(ByteMismatch, match="1 bytes differ"):
        check_bytes(again, first, "flipped")
    with pytest.raises(ByteMismatch):
        check_bytes(first[:, :4], first, "short")


def test_workload_rejects_pages_that_do_not_split_into_tokens() -> None:
    with pytest.raises(ValueError, match="multiple"):
        Workload(page_bytes=1000)


@pytest.mark.parametrize(
    ("op", "path", "column", "expected"),
    [
        ("restore", "local DRAM", "mooncake", "memcpy"),
        ("restore", "local SSD", "flatcake", "odirect_read"),
        ("put", "local SSD", "lmcache", "odirect_write"),
        ("restore", "remote DRAM", "flatcake", "nixl_default"),
        ("restore", "remote DRAM", "flatcake_tcp", "nixl_tcp"),
        ("restore", "remote DRAM", "mooncake", "tcp_loopback"),
        ("restore", "remote SSD", "flatcake", "odirect_read"),  # the lower of disk and wire
        ("restore", "remote SSD", "flatcake_tcp", "nixl_tcp"),
    ],
)
def test_each_cell_is_held_against_its_own_limit(op, path, column, expected) -> None:
    assert limit_of(op, path, column, LIMITS) == (expected, LIMITS[expected])


def _results() -> dict:
    return {
        "config": {
            "command": "python -m benchmarks.peers --pages 8",
            "pages": 8,
            "layers": 2,
            "page_bytes": 1024,
            "bytes": 16384,
            "rounds": 1,
            "scale_pages": 4,
            "versions": {"lmcache": "0.5.6"},
            "wall_seconds": 1.0,
            "load_before": 0.5,
            "load_after": 0.7,
        },
        "limits": LIMITS,
        "flatcake": {"restore": {"local DRAM": {"gbps": 5.0}}, "put": {}},
        "mooncake": {"restore": {"local DRAM": {"gbps": 2.5}}, "put": {}},
    }


def test_markdown_puts_systems_side_by_side_with_ratios() -> None:
    text = markdown(_results())
    row = next(line for line in text.splitlines() if line.startswith("| local DRAM"))
    assert "5.00 (0.50)" in row  # FlatCake, half of memcpy
    assert "2.50 (0.25)" in row  # Mooncake
    assert "2.0x" in row
    assert "—" in row  # columns that did not run


def test_a_limit_sampled_beside_a_row_is_the_one_it_is_held_against() -> None:
    results = _results()
    results["flatcake"]["restore"]["local DRAM"]["limits"] = {"memcpy": 20.0}
    row = next(line for line in markdown(results).splitlines() if line.startswith("| local DRAM"))
    assert "5.00 (0.25)" in row  # FlatCake against the memcpy sampled beside it
    assert "2.50 (0.25)" in row  # Mooncake against the run's memcpy (10)
    assert "memcpy beside FlatCake 20.00" in row and "memcpy 10.00" in row


def test_write_section_replaces_only_between_its_markers(tmp_path) -> None:
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# Head\n\n{START}\nold table\n{END}\n\n## Next\nkept\n")
    write_section(str(doc), "new table\n")
    text = doc.read_text()
    assert "old table" not in text
    assert f"{START}\nnew table\n{END}" in text
    assert text.startswith("# Head\n") and text.endswith("## Next\nkept\n")


def test_write_section_appends_markers_when_absent(tmp_path) -> None:
    doc = tmp_path / "B.md"
    doc.write_text("# Head\n")
    write_section(str(doc), "table\n")
    assert doc.read_text() == f"# Head\n\n{START}\ntable\n{END}\n"


def test_the_scale_table_gives_each_aggregate_as_a_fraction_of_two_clients() -> None:
    results = _results()
    row = {"restore_gbps": 4.0, "put_gbps": 2.0, "put_local_share": 0.5}
    results["flatcake"]["scale"] = {
        "2": {**row, "clients": 4},
        "8": {"restore_gbps": 3.6, "put_gbps": 1.0, "put_local_share": 0.5, "clients": 16},
    }
    lines = markdown(results).splitlines()
    eight = next(line for line in lines if line.startswith("| 8 (16)"))
    assert "3.60 (0.90)" in eight and "1.00 (0.50 local, 0.50)" in eight
    two = next(line for line in lines if line.startswith("| 2 (4)"))
    assert "4.00 |" in two and "2.00 (0.50 local)" in two  # no fraction of itself


def test_the_control_table_shows_a_remote_and_a_local_owner() -> None:
    from benchmarks.peers.report import control_table

    remote = {"warm_ms": 3.2, "cold_ms": 3.4, "warm_calls": 1, "cold_calls": 2}
    local = {"warm_ms": 1.3, "cold_ms": 2.5, "warm_calls": 1, "cold_calls": 3}
    local |= {"warm_direct": 1, "cold_direct": 2}
    results = {"config": {"pages": 3421}, "flatcake": {"control": {**remote, "local": local}}}
    rows = control_table(results)
    assert rows[2].startswith("| FlatCake `locate(lease=True)`, owner on another node, warm")
    assert rows[2].endswith("(1 calls, 0 direct) | 3.20 |")
    assert rows[4].startswith(
        "| FlatCake `locate(lease=True)`, owner on the client's machine, warm"
    )
    assert rows[4].endswith("(1 calls, 1 direct) | 1.30 |") and rows[5].endswith("| 2.50 |")
