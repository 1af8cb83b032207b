"""How an engine process names its Ray cluster (integrations._ray_connect): never "auto"."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from flatcake_ray.errors import ConfigError
from flatcake_ray.integrations._ray_connect import parent_raylet, resolve


@pytest.fixture
def fake_raylet():
    """A real process whose command line carries a raylet's flags."""
    argv = [
        sys.executable,
        "-c",
        "import time; time.sleep(60)",
        "--node_id=abc",
        "--gcs-address=127.0.0.1:6390",
        "--temp_dir=/tmp/fc-node-2",
    ]
    proc = subprocess.Popen(argv)
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 10
    while b"--gcs-address" not in cmdline.read_bytes():  # until the exec shows in /proc
        assert time.monotonic() < deadline, "the fake raylet never started"
        time.sleep(0.01)
    yield proc.pid
    proc.kill()
    proc.wait()


def test_explicit_address_wins(fake_raylet):
    env = {"RAY_RAYLET_PID": str(fake_raylet), "RAY_ADDRESS": "127.0.0.1:1"}
    target = resolve({"ray_address": "127.0.0.1:7000"}, env)
    assert (target.address, target.temp_dir) == ("127.0.0.1:7000", None)


def test_auto_is_refused():
    with pytest.raises(ConfigError, match="not 'auto'"):
        resolve({"ray_address": "auto"}, {})


def test_a_ray_workers_descendant_joins_its_raylets_cluster_and_node(fake_raylet):
    target = resolve({}, {"RAY_RAYLET_PID": str(fake_raylet), "RAY_ADDRESS": "127.0.0.1:1"})
    assert (target.address, target.temp_dir) == ("127.0.0.1:6390", "/tmp/fc-node-2")


def test_ray_address_from_the_environment_next():
    assert resolve({}, {"RAY_ADDRESS": "127.0.0.1:6500"}).address == "127.0.0.1:6500"


def test_a_dead_or_foreign_raylet_pid_is_ignored():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert parent_raylet({"RAY_RAYLET_PID": str(dead.pid)}) is None
    assert parent_raylet({"RAY_RAYLET_PID": "not-a-pid"}) is None


def test_nothing_to_name_the_cluster_by_is_a_config_error():
    with pytest.raises(ConfigError, match="ray_address"):
        resolve({}, {})
