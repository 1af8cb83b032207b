"""examples/cluster.yaml as written: Ray's own autoscaler schema accepts it, its image runs the
Ray this package is tested with, the wheel it ships builds with every package, its drive
command formats a drive only when the drive holds no file system, and its `flatcake-ray`
commands, taken from the file, leave a storage node on every node of a local two-node Ray
cluster that runs with the token authentication the file turns on.

What differs from a real `ray up`, and nothing else: the `flatcake-ray` program is this
venv's; ``--address auto`` becomes the test cluster's address (other Ray clusters run on this
machine); the container paths of file_mounts become their sources (the service config from
examples/, a fresh token in a temporary folder instead of ~/.ray); the service config's
per-machine values are overridden with the documented FLATCAKE_* variables (a root with
``{node}``, since all Ray nodes share this machine, and sizes for a 24 GiB machine instead of
1 TB drives); in the drive command, /mnt is a temporary folder and the commands that touch
devices are recording stand-ins (this machine has no spare NVMe drive).
"""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
import yaml

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.long

REPO = Path(__file__).resolve().parents[1]
CLUSTER_YAML = REPO / "examples" / "cluster.yaml"
RUNNER = Path(__file__).with_name("cluster_yaml_runner.py")
WORKERS = 1  # a head and a worker that joins after it: what `ray up` does, smallest
RUN_TIMEOUT_S = 480
SMALL_NODE = {  # sizes for this machine; the file's are for 1 TB drives and 256 GiB hosts
    "FLATCAKE_DRAM_BYTES": "8MiB",
    "FLATCAKE_SSD_FILE_BYTES": "8MiB",
    "FLATCAKE_SSD_FILES_PER_DIR": "2",
    "FLATCAKE_SHIP_BYTES": "4MiB",
}


@pytest.fixture(scope="module")
def spec() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def flatcake_commands(spec: dict, key: str) -> list[str]:
    return [c for c in spec[key] if c.startswith("flatcake-ray ")]


def docker_env(spec: dict) -> dict[str, str]:
    pairs = [o.removeprefix("--env=") for o in spec["docker"]["run_options"] if "--env=" in o]
    return dict(pair.split("=", 1) for pair in pairs)


def mount_source(spec: dict, remote: str) -> str:
    return spec["file_mounts"][remote]


def localize(command: str, mounts: dict[str, str]) -> str:
    """The command with each file_mounts target replaced by where it comes from here."""
    for remote, local in mounts.items():
        command = command.replace(remote, local)
    return command


# ---- the file itself ------------------------------------------------------------------------
def test_rays_autoscaler_schema_accepts_it(spec):
    from jsonschema import ValidationError
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(spec)))  # what `ray up` does before launching
    broken = copy.deepcopy(spec)
    broken["docker"]["run_option"] = broken["docker"].pop("run_options")  # a typo
    with pytest.raises(ValidationError):
        validate_config(prepare_config(broken))


def test_its_image_and_install_pin_the_ray_this_package_runs_with(spec):
    from packaging.requirements import Requirement

    image = re.fullmatch(r"rayproject/ray:([\d.]+)-py(\d)(\d+)-gpu", spec["docker"]["image"])
    assert image, spec["docker"]["image"]
    version, python = image.group(1), f"{image.group(2)}.{image.group(3)}"
    assert version == ray.__version__
    assert f"ray=={version}" in (REPO / "constraints.txt").read_text().split()
    assert any(f'"ray=={version}"' in command for command in spec["setup_commands"])
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = next(Requirement(r) for r in project["dependencies"] if r.startswith("ray"))
    assert wanted.specifier.contains(version)
    assert Requirement(f"python{project['requires-python']}").specifier.contains(python)


def test_its_token_authentication_is_on_with_a_token_it_ships(spec):
    env = docker_env(spec)
    assert env["RAY_AUTH_MODE"] == "token"
    token_dir = os.path.dirname(env["RAY_AUTH_TOKEN_PATH"])
    assert mount_source(spec, token_dir) == "~/.ray"  # where `ray get-auth-token` writes


def test_every_node_exports_metrics_on_the_port_it_documents(spec):
    documented = re.search(r"Prometheus text on port (\d+)", CLUSTER_YAML.read_text())
    assert documented, "the file says where the metrics are"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in spec[key] if " ray start " in f" {c}"]
        assert f"--metrics-export-port={documented.group(1)}" in start.split(), start


def test_the_service_config_it_mounts_is_valid_and_outlives_the_container(spec):
    from flatcake_ray.cli import build_parser
    from flatcake_ray.cli.service import config_from_args

    mounts = {remote: str(REPO / local) for remote, local in spec["file_mounts"].items()}
    for command in flatcake_commands(spec, "head_start_ray_commands") + flatcake_commands(
        spec, "worker_start_ray_commands"
    ):
        argv = localize(command, mounts).split()[1:]
        config = config_from_args(build_parser().parse_args(argv))
        bound = [o.split()[1].split(":")[1] for o in spec["docker"]["run_options"] if "-v " in o]
        # On the host (a bound folder): a restarted container keeps its NodeID and pool.
        assert any(config.root.startswith(folder + "/") for folder in bound), config.root
        assert "{node}" not in config.root  # one node per machine: a fixed root


def test_the_wheel_it_ships_builds_with_every_package(spec, tmp_path):
    makefile = (REPO / "Makefile").read_text()
    assert mount_source(spec, "/home/ray/flatcake-dist") == re.search(
        r"^DIST \?= (\S+)$", makefile, re.M
    ).group(1)
    bin_dir = str(Path(sys.executable).parent)
    subprocess.run(
        ["make", "-s", "-C", str(REPO), "wheel", "STAMP=", f"BIN={bin_dir}", f"DIST={tmp_path}"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("flatcake_ray-*-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    for package in project["tool"]["setuptools"]["packages"]:
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    assert any(n.startswith("flatcake_ray/cuda_ext/") and n.endswith(".cu") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert (
        "flatcake-ray = flatcake_ray.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    )


# ---- the drive command ----------------------------------------------------------------------
STUBS = {
    "sudo": 'exec "$@"',
    "lsblk": (
        "printf '%s Amazon EC2 NVMe Instance Storage\\n' /dev/fake0 /dev/fake1\n"
        "printf '/dev/boot0 Amazon Elastic Block Store\\n'"
    ),
    "blkid": (
        'dev="${@: -1}"; fs="$STATE/$(basename "$dev").fs"; echo "blkid $*" >> "$STATE/log"\n'
        'if [ "$1" = "-p" ]; then\n'
        '  [ -f "$STATE/$(basename "$dev").unclear" ] && exit 8\n'
        '  [ -f "$fs" ] && exit 0 || exit 2\n'
        "fi\n"
        'cat "$fs"'
    ),
    "mkfs.ext4": (
        'dev="${@: -1}"; echo "mkfs $dev" >> "$STATE/log"\n'
        'echo "$(basename "$dev")-$RANDOM$RANDOM" > "$STATE/$(basename "$dev").fs"'
    ),
    "mountpoint": '[ -f "$STATE/mounted$(echo "${@: -1}" | tr / _)" ]',
    "mount": ('echo "mount $*" >> "$STATE/log"; touch "$STATE/mounted$(echo "${@: -1}" | tr / _)"'),
}


@pytest.fixture
def drive_command(spec, tmp_path):
    """Runs the file's drive command with /mnt in tmp_path and recording device commands."""
    (command,) = [c for c in spec["initialization_commands"] if "mkfs" in c]
    stubs, state, mnt = tmp_path / "bin", tmp_path / "state", tmp_path / "mnt"
    for folder in (stubs, state, mnt):
        folder.mkdir()
    for name, body in STUBS.items():
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "STATE": str(state)}

    def run() -> tuple[int, list[str], list[str]]:
        (state / "log").write_text("")
        done = subprocess.run(
            ["bash", "-c", command.replace("/mnt/", f"{mnt}/")], env=env, check=False
        )
        log = (state / "log").read_text().splitlines()
        return done.returncode, log, sorted(p.name for p in mnt.iterdir())

    yield run, state


def test_a_drive_is_formatted_only_when_it_holds_no_file_system(drive_command):
    run, state = drive_command
    rc, log, first = run()  # new drives: formatted, mounted, one pool folder each
    assert rc == 0 and sorted(line for line in log if line.startswith("mkfs")) == [
        "mkfs /dev/fake0",
        "mkfs /dev/fake1",
    ]
    assert len(first) == 2 and sum(line.startswith("mount") for line in log) == 2
    for marker in state.glob("mounted*"):  # a reboot: nothing mounted, the drives keep data
        marker.unlink()
    rc, log, again = run()
    assert rc == 0 and not any(line.startswith("mkfs") for line in log)
    assert again == first and sum(line.startswith("mount") for line in log) == 2
    rc, log, _ = run()  # `ray up` once more on a running node: nothing to do
    assert rc == 0 and not any(line.startswith(("mkfs", "mount")) for line in log)
    (state / "fake1.fs").unlink()
    (state / "fake1.unclear").touch()  # blkid cannot tell: left alone, `ray up` stops
    for marker in state.glob("mounted*"):
        marker.unlink()
    rc, log, _ = run()
    assert rc != 0 and not any(line.startswith("mkfs") for line in log)


# ---- its commands on a local cluster --------------------------------------------------------
@pytest.fixture
def run_on_local_cluster(tmp_path):
    """Starts the runner (its own process group) and removes what it may leave behind."""
    started: list[subprocess.Popen] = []

    def start(job: dict, env: dict[str, str]) -> tuple[dict, str]:
        process = subprocess.Popen(
            [sys.executable, str(RUNNER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
            start_new_session=True,
        )
        started.append(process)
        out, err = process.communicate(json.dumps(job), timeout=RUN_TIMEOUT_S)
        assert process.returncode == 0, err[-6000:]
        return json.loads(out), err

    yield start
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.ray
def test_its_flatcake_ray_commands_put_a_storage_node_on_every_node(
    spec, tmp_path, run_on_local_cluster
):
    head = flatcake_commands(spec, "head_start_ray_commands")
    worker = flatcake_commands(spec, "worker_start_ray_commands")
    assert len(head) == len(worker) == 1  # the file's shape: one start after each `ray start`
    token_dir = tmp_path / "ray"
    token_dir.mkdir()
    (token_dir / "auth_token").write_text(secrets.token_hex(32))
    mounts = {
        remote: str(token_dir) if local == "~/.ray" else str(REPO / local)
        for remote, local in spec["file_mounts"].items()
    }
    program = str(Path(sys.executable).with_name("flatcake-ray"))

    def here(command: str) -> str:
        command = localize(command, mounts).replace("--address auto", "--address @ADDRESS@")
        return command.replace("flatcake-ray ", f"{program} ", 1)

    cluster_env = {k: localize(v, mounts) for k, v in docker_env(spec).items()}
    command_env = {"FLATCAKE_ROOT": str(tmp_path / "nodes" / "{node}"), **SMALL_NODE}
    job = {
        "head": [here(c) for c in head],
        "worker": [here(c) for c in worker],
        "workers": WORKERS,
        "status": f"{program} status --json --address @ADDRESS@",
        "stop": f"{program} stop --address @ADDRESS@",
        "env": command_env,
    }
    result, _ = run_on_local_cluster(job, cluster_env)

    for step in [*result["steps"], *result["statuses"], result["stop"]]:
        assert step["rc"] == 0, step
    seen = [json.loads(s["stdout"]) for s in result["statuses"]]
    assert [len(info["nodes"]) for info in seen] == list(range(1, WORKERS + 2))  # one per node
    final = seen[-1]
    assert sorted(r["ray_node_id"] for r in final["nodes"]) == sorted(result["ray_node_ids"])
    assert len({r["node_id"] for r in final["nodes"]}) == WORKERS + 1
    assert final["coordinator"]["nodes"] == WORKERS + 1
    assert f"stopped {WORKERS + 2} actors" in result["stop"]["stdout"]
    refused = result["wrong_token"]
    assert refused["rc"] != 0 and "token" in refused["stderr"].lower()
