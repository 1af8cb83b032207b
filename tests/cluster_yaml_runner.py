"""Run cluster.yaml's `flatcake-ray` commands against a local multi-node Ray cluster.

Started by tests/test_cluster_yaml.py in a process of its own, because the cluster runs with
token authentication on (RAY_AUTH_MODE=token, from the environment the test gives it) and
Ray reads that setting once per process: the test's own process must stay as it is.

Reads a JSON spec on stdin: {"head": [commands], "worker": [commands], "workers": N,
"status": command, "stop": command, "env": {...}}; every ``@ADDRESS@`` in a command becomes the
cluster's address. Like `ray up`, it starts the head and runs the head's commands, then adds
the workers one at a time and runs the worker commands after each joins. After each step it
runs ``status``; at the end ``stop``. Prints one JSON object: the commands' outcomes, the
status after each step, every Ray node id, and whether a wrong token was refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

COMMAND_TIMEOUT_S = 180


def run(command: str, address: str, env: dict[str, str]) -> dict[str, Any]:
    command = command.replace("@ADDRESS@", address)
    began = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", command],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    return {
        "command": command,
        "rc": done.returncode,
        "seconds": round(time.monotonic() - began, 1),
        "stdout": done.stdout[-4000:],
        "stderr": done.stderr[-4000:],
    }


def wrong_token_refused(address: str) -> dict[str, Any]:
    """One GCS call with a wrong token (a raw GCS client fails in seconds; ray.init retries
    for about 20 s): proves the cluster really enforces the token."""
    probe = (
        "from ray._raylet import GcsClient\n"
        f"GcsClient(address={address!r}).internal_kv_get(b'k', b'flatcake-ray', timeout=5)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "RAY_AUTH_TOKEN": "not-the-cluster-token"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return {"rc": done.returncode, "stderr": done.stderr[-2000:]}


def main() -> None:
    from ray.cluster_utils import Cluster

    spec = json.load(sys.stdin)
    out: dict[str, Any] = {"steps": [], "statuses": []}
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        nodes = [cluster.head_node]
        steps = [("head", spec["head"])] + [("worker", spec["worker"])] * spec["workers"]
        for kind, commands in steps:
            if kind == "worker":
                nodes.append(cluster.add_node(num_cpus=1))
                cluster.wait_for_nodes()
            out["steps"] += [run(c, cluster.address, spec["env"]) for c in commands]
            status = run(spec["status"], cluster.address, spec["env"])
            out["statuses"].append(status)
        out["ray_node_ids"] = [node.node_id for node in nodes]
        out["wrong_token"] = wrong_token_refused(cluster.address)
        out["stop"] = run(spec["stop"], cluster.address, spec["env"])
    finally:
        cluster.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
