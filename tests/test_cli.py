"""The ``flatcake-ray`` command through its ``main()``: every error a user can cause is one
line on stderr and a non-zero exit; ``--debug`` adds the traceback; connecting to an
address where no cluster runs gives up within the connect timeout."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from flatcake_ray.cli import main

ERROR = "flatcake-ray: error: "


def run(capsys, *argv: str) -> tuple[int, list[str]]:
    code = main(list(argv))
    lines = capsys.readouterr().err.splitlines()
    return code, lines


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nowhere() -> list[str]:
    """Where ``start`` would deploy if its config were accepted: no cluster, so a regression
    fails fast here instead of starting a local Ray and a service."""
    return ["--address", f"127.0.0.1:{closed_port()}", "--connect-timeout", "2"]


def assert_one_line(code: int, lines: list[str], *needles: str) -> None:
    assert code != 0
    assert len(lines) == 1 and lines[0].startswith(ERROR), lines
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def bad_config(tmp_path):
    path = tmp_path / "service.json"
    path.write_text(json.dumps({"ssd_dirs": "/path"}))
    return str(path)


def test_config_errors_are_one_line(capsys, bad_config):
    code, lines = run(capsys, "start", *nowhere(), "--config", bad_config)
    assert_one_line(code, lines, '"ssd_dirs"', bad_config)
    code, lines = run(capsys, "start", *nowhere(), "--page-bytes", "2.5")
    assert_one_line(code, lines, "--page-bytes")
    code, lines = run(capsys, "start", *nowhere(), "--config", bad_config + ".absent")
    assert_one_line(code, lines, "cannot read config file")


def test_usage_errors_are_one_line(capsys):
    for argv in (["no-such-command"], ["status", "--connect-timeout", "-3"], ["trace"]):
        code, lines = run(capsys, *argv)
        assert code == 2
        assert len(lines) == 1 and lines[0].startswith(ERROR), lines


def test_other_user_errors_are_one_line(capsys, tmp_path):
    code, lines = run(capsys, "trace", "stats", str(tmp_path / "absent.jsonl"))
    assert_one_line(code, lines)
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("this is not a trace\n")
    code, lines = run(capsys, "trace", "stats", str(garbage))
    assert_one_line(code, lines)
    listed = tmp_path / "profile.json"
    listed.write_text("[1]")
    code, lines = run(capsys, "replay", "--profile-json", str(listed))
    assert_one_line(code, lines, "--profile-json")
    code, lines = run(capsys, "replay", "--set", "no-equals-sign", "--synth", "chat")
    assert_one_line(code, lines, "--set")


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_prints_the_traceback(capsys, bad_config, where):
    argv = ["start", *nowhere(), "--config", bad_config]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1 and "Traceback (most recent call last)" in err
    assert err.splitlines()[-1].startswith(ERROR)


@pytest.mark.parametrize("command", ["status", "stop"])
def test_no_cluster_at_the_address_fails_within_the_connect_timeout(capsys, command):
    address = f"127.0.0.1:{closed_port()}"
    started = time.monotonic()
    code, lines = run(capsys, command, "--address", address, "--connect-timeout", "5")
    assert time.monotonic() - started < 30
    assert_one_line(code, lines, "no Ray cluster answers", str(address.split(":")[1]))


def test_a_listener_that_never_answers_is_cut_off_by_the_connect_timeout(tmp_path):
    """Something accepts TCP but is not a Ray cluster: ``ray.init`` would wait for minutes.
    Run in a child process so that the cut-off driver leaves nothing in this one."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        argv = ["status", "--address", address, "--connect-timeout", "4"]
        code = f"import sys; from flatcake_ray.cli import main; sys.exit(main({argv!r}))"
        started = time.monotonic()
        child = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "RAY_ADDRESS": ""},
        )
        elapsed = time.monotonic() - started
    assert child.returncode == 1, child.stderr
    last = child.stderr.strip().splitlines()[-1]
    assert last.startswith(ERROR) and "not answering as Ray" in last, child.stderr
    assert elapsed < 60
