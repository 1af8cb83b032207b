"""Deploy, inspect and stop the service on a running Ray cluster.

``start`` creates (or finds) the detached CapacityCoordinator in the service's namespace,
then one detached StorageNode per alive Ray node, each pinned to its node with a hard
``NodeAffinitySchedulingStrategy``. It is idempotent: run it again after nodes join and only
the new ones get a storage node. The actors take no CPU slot (``num_cpus=0``): they serve
control calls; bytes move in the callers' processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from flatcake_ray.actors.auth import load_or_create_secret, read_secret
from flatcake_ray.actors.protocol import COORDINATOR_NAME, NODE_NAME_PREFIX, node_actor_name
from flatcake_ray.config import ServiceConfig, secret_path
from flatcake_ray.errors import AccessDeniedError, ServiceError

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0
# An operator call's bound: it bounds only a failure, and on a loaded machine a call that
# pushes to every node takes seconds.
ADMIN_TIMEOUT_S = 60.0


def connect(address: str | None, namespace: str) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace=namespace, log_to_driver=False)


def _affinity(node_id: str, soft: bool) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)


def start_coordinator(config: ServiceConfig, secret: str) -> Any:
    """The coordinator's handle, creating it (on this node, softly) when absent."""
    import ray

    from flatcake_ray.actors.coordinator import CapacityCoordinator

    here = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(CapacityCoordinator)
        .options(
            name=COORDINATOR_NAME,
            namespace=config.namespace,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,  # a crash restarts it, and it rebuilds from the storage nodes
            num_cpus=0,
            scheduling_strategy=_affinity(here, soft=True),
        )
        .remote(config, secret)
    )


def service_nodes(resource: str | None = None) -> list[str]:
    """Alive Ray node ids that get a storage node (all, or those offering ``resource``)."""
    import ray

    return [
        n["NodeID"]
        for n in ray.nodes()
        if n["Alive"] and (resource is None or n.get("Resources", {}).get(resource, 0) > 0)
    ]


def start_storage_node(config: ServiceConfig, ray_node_id: str, secret: str) -> Any:
    import ray

    from flatcake_ray.actors.storage_node import StorageNode

    return (
        ray.remote(StorageNode)
        .options(
            name=node_actor_name(ray_node_id),
            namespace=config.namespace,
            lifetime="detached",
            get_if_exists=True,
            # A death restarts it on its node and root: SSD scopes come back from the manifest
            # (actors/supervision.py says what DRAM it lost); readers see its new epoch.
            max_restarts=-1,
            num_cpus=0,
            max_concurrency=config.node_concurrency,
            scheduling_strategy=_affinity(ray_node_id, soft=False),
        )
        .remote(config, secret)
    )


def start(
    config: ServiceConfig,
    *,
    address: str | None = None,
    resource: str | None = None,
    nodes: Iterable[str] | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> dict[str, Any]:
    """Deploy the coordinator and the storage nodes; returns :func:`status` once all answer.
    The service secret is read from ``config.secret_file`` (made there on the first start);
    a running service started with another secret refuses this start."""
    import ray

    secret = load_or_create_secret(config.secret_path)
    connect(address, config.namespace)
    coordinator = start_coordinator(config, secret)
    wait_until_answers(coordinator, time.monotonic() + timeout_s)
    running = _unwrapped(coordinator.service_config.remote(secret), timeout_s)
    config.check_same_geometry(running)
    targets = list(nodes) if nodes is not None else service_nodes(resource)
    if not targets:
        raise ServiceError("no alive Ray node to run a storage node on")
    handles = [start_storage_node(config, node, secret) for node in targets]
    deadline = time.monotonic() + timeout_s
    for handle in handles:
        ray.get(handle.ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
    return status(config.namespace, secret)


def wait_until_answers(handle: Any, deadline: float) -> None:
    """Wait until ``handle`` answers a ping; a restarting actor (the coordinator after a
    crash: Ray restarts it) is waited for, not an error, until ``deadline``."""
    import ray
    from ray.exceptions import ActorUnavailableError

    while True:
        try:
            ray.get(handle.ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
            return
        except ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def _unwrapped(ref: Any, timeout_s: float) -> Any:
    """``ray.get``, with a refusal raised as the plain AccessDeniedError it is."""
    import ray

    try:
        return ray.get(ref, timeout=timeout_s)
    except AccessDeniedError:
        raise AccessDeniedError(
            "the running service refused this caller's service secret: run this where "
            "`flatcake-ray start` first ran, or point --secret-file at its secret"
        ) from None


def _named(namespace: str) -> list[str]:
    import ray

    return sorted(
        e["name"]
        for e in ray.util.list_named_actors(all_namespaces=True)
        if e["namespace"] == namespace and e["name"].startswith(NODE_NAME_PREFIX)
    )


def _actor(name: str, namespace: str) -> Any:
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def operator_secret(namespace: str) -> str:
    """The service secret of ``namespace`` as this machine keeps it (``secret_path``)."""
    return read_secret(secret_path(namespace))


def status(
    namespace: str, secret: str | None = None, timeout_s: float = ADMIN_TIMEOUT_S
) -> dict[str, Any]:
    """The coordinator's view merged with every storage node's own stats (``secret``: the
    service secret, by default the one this machine keeps)."""
    import ray

    secret = secret or operator_secret(namespace)
    from ray.exceptions import RayError

    coordinator = _actor(COORDINATOR_NAME, namespace)
    info: dict[str, Any] = {"coordinator": None, "nodes": []}
    placement: dict[int, dict[str, Any]] = {}
    if coordinator is not None:
        try:
            info["coordinator"] = _unwrapped(coordinator.info.remote(secret), timeout_s)
            rows = _unwrapped(coordinator.nodes_table.remote(secret), timeout_s)
            placement = {row["node_id"]: row for row in rows}
        except RayError as exc:
            info["coordinator_error"] = str(exc)
    handles = [h for h in (_actor(n, namespace) for n in _named(namespace)) if h is not None]
    refs = [h.stats.remote(secret) for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in refs:
        if ref not in ready:
            continue
        try:
            stats = ray.get(ref)
        except RayError as exc:
            info.setdefault("node_errors", []).append(str(exc))
            continue
        info["nodes"].append(_row(stats, placement.get(stats["node_id"], {})))
    answered = {row["node_id"] for row in info["nodes"]}
    # Nodes the coordinator knows that did not answer (lost with their Ray node, or silent):
    # shown from its view, so an operator sees them down rather than not at all.
    info["nodes"] += [_unanswered(row) for n, row in placement.items() if n not in answered]
    info["nodes"].sort(key=lambda row: row["node_id"])
    return info


def _unanswered(placed: dict[str, Any]) -> dict[str, Any]:
    """The row of a node that did not answer, from the coordinator's last report of it."""
    state = placed["state"] if placed["state"] != "up" else "noreply"  # up, yet mute here
    unknown = ("sessions", "hit_pages", "lookups", "puts")
    row = {**{name: placed[name] for name in _FROM_COORDINATOR}, **dict.fromkeys(unknown, 0)}
    return {**row, "state": state, "alive": False, "nixl": "-"}


_FROM_COORDINATOR = (
    "node_id",
    "ray_node_id",
    "dram_capacity",
    "dram_used",
    "ssd_capacity",
    "ssd_used",
    "scopes",
    "pages",
    "placed",
    "drained",
    "lost_dram_scopes",
    "lost_dram_pages",
    "lost_dram_bytes",
)


def _row(stats: dict[str, Any], placed: dict[str, Any]) -> dict[str, Any]:
    return {
        "node_id": stats["node_id"],
        "ray_node_id": stats["ray_node_id"],
        "state": placed.get("state", "up"),
        "alive": placed.get("alive", True),
        "dram_capacity": stats["dram_capacity"],
        "dram_used": stats["dram_used"],
        "ssd_capacity": stats["ssd_capacity"],
        "ssd_used": stats["ssd_reserved"],
        "scopes": stats["scopes"],
        "sessions": stats["sessions"],
        "pages": stats["pages_indexed"],
        "hit_pages": stats["leased_pages"],  # pages found and leased to readers
        "lookups": stats["lookups"],
        "puts": stats["puts"],
        "placed": placed.get("placed", 0),
        "drained": placed.get("drained", False),
        "nixl": stats["nixl"],
        # What this node's last death lost (a restart, or a lost node it took over from).
        "lost_dram_scopes": stats["lost_dram_scopes"],
        "lost_dram_pages": stats["lost_dram_pages"],
        "lost_dram_bytes": stats["lost_dram_bytes"],
    }


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f}"


def format_status(info: dict[str, Any]) -> str:
    """A plain-text table: one row per storage node."""
    head = (
        f"{'node':>4} {'state':<7} {'ray node':<12} {'dram GiB used/cap':>18} "
        f"{'ssd GiB used/cap':>18} {'scopes':>6} {'pages':>8} {'lookups':>8} {'hits':>9} "
        f"{'puts':>6}  nixl"
    )
    lines = [head]
    for r in info["nodes"]:
        lines.append(
            f"{r['node_id']:>4} {r['state']:<7} {r['ray_node_id'][:12]:<12} "
            f"{_gib(r['dram_used']) + '/' + _gib(r['dram_capacity']):>18} "
            f"{_gib(r['ssd_used']) + '/' + _gib(r['ssd_capacity']):>18} "
            f"{r['scopes']:>6} {r['pages']:>8} {r['lookups']:>8} {r['hit_pages']:>9} "
            f"{r['puts']:>6}  {r['nixl']}"
        )
    lines += [_lost_line(r) for r in info["nodes"] if r["state"] == "lost"]
    coordinator = info.get("coordinator")
    if coordinator is None:
        lines.append(f"coordinator: not answering ({info.get('coordinator_error', 'absent')})")
    else:
        lines.append(
            f"coordinator: {coordinator['nodes']} nodes, {coordinator['sessions']} sessions, "
            f"{coordinator['placements']} placements"
        )
        if coordinator.get("drained"):
            drained = ", ".join(str(n) for n in coordinator["drained"])
            lines.append(f"drained (no new scopes; undo with `flatcake-ray undrain`): {drained}")
    return "\n".join(lines)


def _lost_line(row: dict[str, Any]) -> str:
    return (
        f"lost: NodeID {row['node_id']} (its Ray node {row['ray_node_id'][:12]} is dead): "
        f"{row['lost_dram_scopes']} DRAM scopes ({row['lost_dram_pages']} pages) gone; its SSD "
        "scopes come back when a storage node starts on its host with its root"
    )


def stop(namespace: str, secret: str | None = None, timeout_s: float = 30.0) -> int:
    """Shut every storage node down (SSD scopes stay on disk), then the coordinator.
    Returns how many actors were stopped. Only the holder of the service secret may."""
    import ray
    from ray.exceptions import RayError

    secret = secret or operator_secret(namespace)
    stopped = 0
    coordinator = _actor(COORDINATOR_NAME, namespace)
    if coordinator is not None:
        wait_until_answers(coordinator, time.monotonic() + timeout_s)  # Ray may be restarting it
        _unwrapped(coordinator.info.remote(secret), timeout_s)  # the secret is the service's
    handles = [h for h in (_actor(n, namespace) for n in _named(namespace)) if h is not None]
    refs = [h.shutdown.remote(secret) for h in handles]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for handle, ref in zip(handles, refs, strict=True):
        try:
            ray.get(ref, timeout=0)
        except RayError as exc:  # already dead or stuck: killed below all the same
            log.warning("a storage node did not shut down cleanly: %s", exc)
        ray.kill(handle, no_restart=True)
        stopped += 1
    if coordinator is not None:
        ray.kill(coordinator, no_restart=True)
        stopped += 1
    return stopped
