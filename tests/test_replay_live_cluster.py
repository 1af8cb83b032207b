"""``flatcake-ray replay --live`` on a tiny local 2-node cluster: the running service, given a
small trace with real bytes, hits the pages by medium and issues the SSD read commands that
the replay model predicts for the same trace, capacities and scale. Counts, not times.
"""

from __future__ import annotations

import json

from flatcake_ray.cli import main


def conversation_trace(path, sessions: int = 12, turns: int = 3) -> None:
    """A Mooncake-format trace: every request starts with the shared block 0 (a system prompt),
    a session's turns extend its own chain, replies alternate short and long (so Table 2
    sends some later turns to DRAM, the rest to SSD with DRAM read replicas)."""
    lines = []
    for turn in range(1, turns + 1):
        for session in range(sessions):
            blocks = [0] + [1 + session * 100 + b for b in range(3 * turn)]
            lines.append(
                {
                    "timestamp": turn * 4000 + session * 150,
                    "input_length": len(blocks) * 512,
                    "output_length": 8 if (session + turn) % 2 else 5000,
                    "hash_ids": blocks,
                }
            )
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def test_live_replay_counts_agree_with_the_model(tmp_path, monkeypatch):
    # The service's default DRAM policy (read replicas), not the tests' table2: replicas made
    # and dropped are where the model and the service could part.
    monkeypatch.setenv("FLATCAKE_DRAM_POLICY", "replica")
    trace = tmp_path / "trace.jsonl"
    conversation_trace(trace)
    out = tmp_path / "out"
    argv = ["replay", str(trace), "--live", "--out", str(out), "--no-progress"]
    argv += ["--time-scale", "0.25"]  # turns 1 s apart, requests 37 ms apart
    # 4 MiB of DRAM a node holds 64 pages of 64 KiB: replicas are dropped, so SSD is read;
    # SSD (32 MiB) has room, so the coordinator keeps every session on its client's node.
    argv += ["--page-bytes", "16KiB", "--dram-bytes", "4MiB", "--ssd-bytes", "32MiB"]
    argv += ["--root", str(tmp_path / "nodes")]
    assert main(argv) == 0  # 0: every restored page read back as written
    result = json.loads((out / "live.json").read_text())
    rows = {row["metric"]: row for row in result["rows"]}
    for metric in ("hit pages, DRAM", "hit pages, SSD", "SSD read commands"):
        assert rows[metric]["measured"] == rows[metric]["predicted"], rows[metric]
    assert rows["hit pages, DRAM"]["measured"] > 0
    assert rows["hit pages, SSD"]["measured"] > 0  # both media were read
    assert rows["SSD read commands"]["measured"] > 0
    assert result["remote_hit_pages"] == 0 and result["failures"] == 0
    assert result["model_counters"]["ssd_read_commands_restore"] > 0
    nodes = [stats["node"] for stats in result["node_stats"].values()]
    assert sum(node["replica_scopes_dropped"] for node in nodes) > 0
    assert {p.name for p in out.glob("*.png")} == {"restore_time_cdf.png", "hits_by_medium.png"}
    assert (out / "live.md").read_text().startswith("| metric |")
