"""Drained NodeIDs: storage nodes an operator is about to remove, which get no new scopes.

The set lives in Ray's GCS key-value store, not in the coordinator. The coordinator's state
is soft (after a restart it rebuilds it from the storage nodes), but a drain must outlive
coordinator restarts, restarts of the drained node itself and ``flatcake-ray stop``/``start``,
and a node that is already gone cannot be asked whether it was drained. The GCS lives as
long as the Ray cluster does (longer with GCS fault tolerance), which is as long as a drain
means anything. The coordinator writes it (``drain``/``undrain``); clients read it on their
periodic node refresh, so a session a client sticks to a drained node moves on too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from flatcake_ray.core.gva import MAX_NODE_ID
from flatcake_ray.errors import ServiceError

KV_NAMESPACE = "flatcake-ray"  # Ray's internal KV namespace (Ray keeps its own apart)


def _key(namespace: str) -> bytes:
    return f"{namespace}/drained".encode()


def encode(node_ids: Iterable[int]) -> bytes:
    return json.dumps(sorted(set(node_ids))).encode()


def decode(raw: bytes | None) -> frozenset[int]:
    """The NodeIDs a stored value names; a value this module did not write is an error."""
    if raw is None:
        return frozenset()
    try:
        ids = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ServiceError(f"the drained-node record is not JSON: {raw[:64]!r}") from exc
    valid = isinstance(ids, list) and all(type(i) is int and 0 < i <= MAX_NODE_ID for i in ids)
    if not valid:
        raise ServiceError(f"the drained-node record is not a list of NodeIDs: {raw[:64]!r}")
    return frozenset(ids)


def kv_store() -> Any:
    """Ray's internal KV store (the GCS's), initialized."""
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        raise ServiceError("Ray is not initialized: the service keeps records in its GCS")
    return internal_kv


def read_drained(namespace: str) -> frozenset[int]:
    raw = kv_store()._internal_kv_get(_key(namespace), namespace=KV_NAMESPACE)
    return decode(raw)


def write_drained(namespace: str, node_ids: Iterable[int]) -> None:
    kv_store()._internal_kv_put(
        _key(namespace), encode(node_ids), overwrite=True, namespace=KV_NAMESPACE
    )
