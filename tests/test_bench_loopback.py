"""Every bench cluster talks over 127.0.0.1 only: ``benchkit.start_local_cluster`` (used by
``bench restore``, ``bench-peers`` and ``benchmarks/control_plane.py``) starts its nodes on
loopback, and a process that joins it is a loopback node too, even where the machine has an
outward address Ray would otherwise pick."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flatcake_ray.cli.benchkit import start_local_cluster

pytestmark = pytest.mark.ray


def test_a_bench_cluster_and_its_driver_are_on_loopback() -> None:
    import ray

    cluster = start_local_cluster(2, "loopbackbench")
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        addresses = {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        assert addresses == {"127.0.0.1"}
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        assert cluster.address.startswith("127.0.0.1:")
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_bench_run_removes_only_the_folder_it_made_inside_its_root(tmp_path) -> None:
    """``--root`` names where a run makes its store folders, not a folder it owns: a run
    given ``/var/tmp`` once removed ``/var/tmp`` itself."""
    mine = tmp_path / "mine.txt"
    mine.write_text("not the bench's")
    flatcake = str(Path(sys.executable).with_name("flatcake-ray"))
    argv = ["bench", "control", "--nodes", "2", "--chains", "1", "--lookups", "2"]
    argv += ["--pages", "64", "--root", str(tmp_path), "--json"]
    run = subprocess.run(
        [flatcake, *argv], capture_output=True, text=True, timeout=600, check=False
    )
    assert run.returncode == 0, run.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]
    assert mine.read_text() == "not the bench's"
