"""Drain a storage node before removing it: ``flatcake-ray drain NODE`` / ``undrain NODE``.

The coordinator stops placing new scopes there and keeps the drained set in Ray's GCS
(``flatcake_ray/actors/drain.py``), so it survives coordinator and node restarts; clients
stop starting new chains there on their next node refresh. The node keeps serving its pages
until it is removed. NODE is the NodeID that ``flatcake-ray status`` shows.
"""

from __future__ import annotations

from typing import Any

from flatcake_ray.actors.protocol import COORDINATOR_NAME
from flatcake_ray.client.deploy import operator_secret
from flatcake_ray.errors import ServiceError


def coordinator_handle(namespace: str) -> Any:
    import ray

    try:
        return ray.get_actor(COORDINATOR_NAME, namespace=namespace)
    except ValueError as exc:
        raise ServiceError(
            f"no coordinator in namespace {namespace!r}: run `flatcake-ray start`"
        ) from exc


def drain(
    node_id: int, namespace: str, secret: str | None = None, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Stop placing new scopes on NodeID ``node_id``; returns its row of the coordinator's
    table. Raises UnknownNodeError for a NodeID the coordinator does not know."""
    import ray

    ref = coordinator_handle(namespace).drain.remote(secret or operator_secret(namespace), node_id)
    return ray.get(ref, timeout=timeout_s)


def undrain(
    node_id: int, namespace: str, secret: str | None = None, timeout_s: float = 10.0
) -> bool:
    """Place scopes on NodeID ``node_id`` again; False if it was not drained."""
    import ray

    ref = coordinator_handle(namespace).undrain.remote(
        secret or operator_secret(namespace), node_id
    )
    return bool(ray.get(ref, timeout=timeout_s))
