"""A storage node's actor handle bound to one caller: every call carries its secret.

Each method of a :class:`~flatcake_ray.actors.storage_node.StorageNode` that a client may
call takes the caller's secret first (a tenant's, or None for the open default tenant). The
client's links, transports and puts hold a :class:`BoundNode` instead of the raw handle, so
no call site can forget it, and only the calls listed in :data:`CLIENT_CALLS` exist on it.
"""

from __future__ import annotations

from typing import Any

CLIENT_CALLS = frozenset(
    {
        *("describe", "service_config", "stats", "accept_rdma", "lookup", "exists", "probe"),
        *("gvas", "release", "begin_put", "land", "commit_put", "abort_put"),
        *("ship", "unship", "ship_stream", "ship_stop", "read_ranges", "record_home"),
        *("home_of", "find", "hand_chunks", "open_calls", "open_remote_calls"),
    }
)


class BoundCall:
    def __init__(self, method: Any, secret: str | None) -> None:
        self._method = method
        self._secret = secret

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._method.remote(self._secret, *args, **kwargs)


class BoundNode:
    """``node.lookup.remote(keys, ns)`` is ``actor.lookup.remote(secret, keys, ns)``."""

    def __init__(self, actor: Any, secret: str | None) -> None:
        self.actor = actor
        self._secret = secret

    def __getattr__(self, name: str) -> BoundCall:
        if name not in CLIENT_CALLS:
            raise AttributeError(f"a client does not call StorageNode.{name}")
        return BoundCall(getattr(self.actor, name), self._secret)
