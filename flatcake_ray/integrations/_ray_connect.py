"""Which Ray cluster, and which node of it, an engine process joins to reach ``store: ray``.

``ray.init("auto")`` attaches to the cluster a file in /tmp/ray names: the last one started on
the machine, which need not be the engine's own. Engines run where their cluster can be named:

1. ``ray_address`` in the engine's options (the GCS address, ``host:port``);
2. Ray already connected in this process (a Ray Serve replica, a Ray worker) - kept as it is;
3. the process descends from a Ray worker (vLLM's engine-core and worker processes under Ray
   Serve LLM): Ray gives workers ``RAY_RAYLET_PID``, and that raylet's command line names the
   cluster (``--gcs-address``) and the node (``--temp_dir``, which tells apart the raylets of
   a one-machine test cluster, where a driver would otherwise join the head node);
4. ``RAY_ADDRESS``, as Ray itself reads it.

Without any of these the process has no cluster to name and fails with a ConfigError instead
of guessing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flatcake_ray.errors import ConfigError

ADDRESS_OPTION = "ray_address"


@dataclass(frozen=True)
class RayTarget:
    address: str
    temp_dir: str | None  # the node's Ray temp folder, where a worker's raylet names one
    source: str  # where the address came from (logs, errors)


def _raylet_flags(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return {}
    flags: dict[str, str] = {}
    for arg in raw.decode(errors="replace").split("\0"):
        name, sep, value = arg.partition("=")
        if sep and name.startswith("--"):
            flags.setdefault(name[2:].replace("-", "_"), value)
    return flags


def parent_raylet(env: Mapping[str, str]) -> RayTarget | None:
    """The cluster and node of the Ray worker this process descends from, if any."""
    pid = env.get("RAY_RAYLET_PID")
    if not pid or not pid.isdigit():
        return None
    flags = _raylet_flags(int(pid))
    address = flags.get("gcs_address")
    if not address:
        return None
    return RayTarget(address, flags.get("temp_dir"), f"raylet {pid} (RAY_RAYLET_PID)")


def resolve(options: Mapping[str, Any], env: Mapping[str, str] | None = None) -> RayTarget:
    env = os.environ if env is None else env
    explicit = options.get(ADDRESS_OPTION)
    if explicit:
        if str(explicit) == "auto":
            raise ConfigError("ray_address must name the cluster (host:port), not 'auto'")
        return RayTarget(str(explicit), None, ADDRESS_OPTION)
    inherited = parent_raylet(env)
    if inherited is not None:
        return inherited
    if env.get("RAY_ADDRESS"):
        return RayTarget(env["RAY_ADDRESS"], None, "RAY_ADDRESS")
    raise ConfigError(
        "store: ray needs the Ray cluster's address: set ray_address (host:port of its GCS) in "
        "the engine's options or RAY_ADDRESS in its environment, or run the engine inside the "
        "cluster (a Ray Serve replica or a Ray task)"
    )


def connect(options: Mapping[str, Any]) -> None:
    """Join the engine's cluster unless this process is connected already."""
    import ray

    if ray.is_initialized():
        return
    target = resolve(options)
    kwargs: dict[str, Any] = {}
    if target.temp_dir:
        kwargs["_temp_dir"] = target.temp_dir
    ray.init(
        address=target.address,
        namespace=str(options.get("ray_namespace", "flatcake")),
        log_to_driver=False,
        **kwargs,
    )
