"""Drain a storage node before removing it: ``flatcake-ray drain NODE`` / ``undrain NODE``.

The coordinator stops placing new scopes there and keeps the drained set in Ray's GCS
(``flatcake_ray/actors/drain.py``), so it survives coordinator and node restarts; clients
stop starting new chains there on their next node refresh. The node keeps serving its pages
until it is removed. NODE is the NodeID that ``flatcake-ray status`` shows.
"""

from __future__ import annotations

import time
from typing import Any

from flatcake_ray.actors.protocol import COORDINATOR_NAME
from flatcake_ray.client.deploy import ADMIN_TIMEOUT_S, operator_secret, wait_until_answers
from flatcake_ray.errors import FlatCakeError, ServiceError


def coordinator_handle(namespace: str) -> Any:
    import ray

    try:
        return ray.get_actor(COORDINATOR_NAME, namespace=namespace)
    except ValueError as exc:
        raise ServiceError(
            f"no coordinator in namespace {namespace!r}: run `flatcake-ray start`"
        ) from exc


def admin_call(
    namespace: str, method: str, secret: str | None, *args: Any, timeout_s: float
) -> Any:
    """One operator call to the coordinator, with the service secret (by default this
    machine's). A coordinator that Ray is restarting is waited for; an error the call raised
    comes back as that typed error, one line."""
    import ray
    from ray.exceptions import RayTaskError

    coordinator = coordinator_handle(namespace)
    wait_until_answers(coordinator, time.monotonic() + timeout_s)
    ref = getattr(coordinator, method).remote(secret or operator_secret(namespace), *args)
    try:
        return ray.get(ref, timeout=timeout_s)
    except RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, FlatCakeError):
            raise type(cause)(*cause.args) from None
        raise


def drain(
    node_id: int, namespace: str, secret: str | None = None, timeout_s: float = ADMIN_TIMEOUT_S
) -> dict[str, Any]:
    """Stop placing new scopes on NodeID ``node_id``; returns its row of the coordinator's
    table. Raises UnknownNodeError for a NodeID the coordinator does not know."""
    return dict(admin_call(namespace, "drain", secret, node_id, timeout_s=timeout_s))


def undrain(
    node_id: int, namespace: str, secret: str | None = None, timeout_s: float = ADMIN_TIMEOUT_S
) -> bool:
    """Place scopes on NodeID ``node_id`` again; False if it was not drained."""
    return bool(admin_call(namespace, "undrain", secret, node_id, timeout_s=timeout_s))
