"""A newcomer's first ``flatcake-ray start`` with no cluster running: it starts a one-node Ray
on 127.0.0.1, deploys on it and ``stop --ray`` stops exactly that Ray, whether or not a Ray
auth token exists in the home folder (``ray start`` turns token auth on by itself when one
does); a ``start`` that fails after starting Ray leaves nothing of it running.

Each case runs the real command in a child process with a home folder and a Ray temp folder
of its own (``RAY_TMPDIR``), so it finds none of the other Ray clusters on this machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flatcake_ray.cli import local_ray

pytestmark = [pytest.mark.ray, pytest.mark.long]

FLATCAKE = str(Path(sys.executable).with_name("flatcake-ray"))
SMALL = ["--layers", "2", "--page-bytes", "4096", "--dram-bytes", "8MiB"]
SMALL += ["--ship-bytes", "1MiB", "--landing-bytes", "1MiB"]


@pytest.fixture
def newcomer(tmp_path):
    """A home and a Ray temp folder (short: Ray's socket paths have a length limit) of their
    own; whatever Ray the case left running is stopped at the end."""
    ray_tmp = tempfile.mkdtemp(prefix="fcr-", dir="/tmp")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env.update(HOME=str(home), RAY_TMPDIR=ray_tmp, FLATCAKE_SECRET_FILE="")
    yield env, tmp_path
    record = home / ".flatcake" / "local-ray.json"
    if record.exists():
        left = local_ray.LocalRay(**json.loads(record.read_text()))
        local_ray.stop(left)
    shutil.rmtree(ray_tmp, ignore_errors=True)


def flatcake(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [FLATCAKE, *argv, "--debug"],
            env=env,
            capture_output=True,
            text=True,
            timeout=360,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"flatcake-ray {' '.join(argv)} hung: {exc.stdout!r} {exc.stderr!r}")


def recorded(env: dict[str, str]) -> local_ray.LocalRay:
    record = Path(env["HOME"]) / ".flatcake" / "local-ray.json"
    return local_ray.LocalRay(**json.loads(record.read_text()))


@pytest.mark.parametrize("token", [True, False], ids=["token", "no-token"])
def test_start_status_stop_on_a_local_ray_it_starts(newcomer, token):
    env, tmp = newcomer
    if token:
        (Path(env["HOME"]) / ".ray").mkdir()
        (Path(env["HOME"]) / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    root = str(tmp / "root" / "{node}")
    started = flatcake(env, "start", "--root", root, *SMALL, "--local-cpus", "1", "--json")
    assert started.returncode == 0, started.stderr
    assert len(json.loads(started.stdout)["nodes"]) == 1
    local = recorded(env)
    assert local.address.startswith("127.0.0.1:")
    assert local.auth_mode == ("token" if token else "disabled")
    status = flatcake(env, "status", "--json", "--metrics-timeout", "1")
    assert status.returncode == 0, status.stderr
    stopped = flatcake(env, "stop", "--ray")
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped the local Ray" in stopped.stdout
    assert not local_ray.session_alive(local.session_dir)
    assert not (Path(env["HOME"]) / ".flatcake" / "local-ray.json").exists()


def test_a_start_that_fails_after_starting_ray_stops_it(newcomer):
    env, tmp = newcomer
    root = str(tmp / "root" / "{node}")
    argv = ["start", "--root", root, *SMALL, "--local-cpus", "1"]
    failed = flatcake(env, *argv, "--resource", "no-node-offers-this")
    assert failed.returncode == 1
    assert "flatcake-ray: error:" in failed.stderr
    sessions = list(Path(env["RAY_TMPDIR"]).glob("ray/session_2*"))
    assert sessions, "the failed start did start a Ray"
    assert not any(local_ray.session_alive(str(session)) for session in sessions)
    assert not (Path(env["HOME"]) / ".flatcake" / "local-ray.json").exists()
