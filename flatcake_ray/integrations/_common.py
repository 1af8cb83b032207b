"""What the engine adapters share: how to reach a store, namespaces, byte views.

An adapter never builds a store itself: it calls :func:`open_store` with the options the engine
was configured with (``kv_connector_extra_config`` in vLLM, the HiCache extra config in
SGLang) and programs against the :class:`~flatcake_ray.core.api.KVStore` it gets back.
``store: local`` opens an in-process :class:`FlatCakeStore` (tests, one-box serving; one
process owns a store root, so an engine whose scheduler and workers are separate processes
gets a typed error naming ``store: ray``); ``store: ray`` attaches to a running FlatCake-Ray
service. Another way to reach a store is one :func:`register_store_opener` call away.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flatcake_ray.config import ClientConfig, StoreConfig, parse_size
from flatcake_ray.config_sources import read_value
from flatcake_ray.core.api import KVStore
from flatcake_ray.errors import ConfigError, FlatCakeError, ShapeError

# Keys that steer the adapter itself; every other ``store_*`` option is a StoreConfig field.
STORE_KIND = "store"
STORE_PREFIX = "store_"


@dataclass(frozen=True)
class Geometry:
    """What the engine's KV looks like to the store: layers and bytes of one layer's page."""

    layers: int
    page_bytes: int


StoreOpener = Callable[[Mapping[str, Any], Geometry], KVStore]

_openers: dict[str, StoreOpener] = {}
_local_stores: dict[str, KVStore] = {}  # root -> the process's one store on it
_users: dict[int, int] = {}  # id(store) -> adapters holding it (local stores are shared)
_local_lock = threading.Lock()


def register_store_opener(kind: str, opener: StoreOpener) -> None:
    """Make ``{"store": kind, ...}`` reach a store through ``opener(options, geometry)``."""
    _openers[kind] = opener


def open_store(options: Mapping[str, Any], geometry: Geometry) -> KVStore:
    """The store ``options`` name, for one adapter; give it back with :func:`release_store`."""
    kind = str(options.get(STORE_KIND, "local"))
    opener = _openers.get(kind)
    if opener is None:
        raise ConfigError(f"unknown store kind {kind!r}; known: {sorted(_openers)}")
    store = opener(options, geometry)
    with _local_lock:
        _users[id(store)] = _users.get(id(store), 0) + 1
    return store


def release_store(store: KVStore) -> None:
    """An adapter is done with ``store``: closed once its last user lets go (an in-process
    store is shared by the adapters of one process; a Ray client belongs to one)."""
    with _local_lock:
        left = _users.get(id(store), 1) - 1
        if left > 0:
            _users[id(store)] = left
            return
        _users.pop(id(store), None)
        for root, known in list(_local_stores.items()):
            if known is store:
                del _local_stores[root]
    store.close()


def _store_fields(options: Mapping[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name, value in options.items():
        if not name.startswith(STORE_PREFIX) or name == STORE_PREFIX + "root":
            continue
        field = name[len(STORE_PREFIX) :]
        fields[field] = parse_size(value) if field.endswith("bytes") else value
    return fields


def _open_local(options: Mapping[str, Any], geometry: Geometry) -> KVStore:
    """One FlatCakeStore per root in this process: vLLM's scheduler-side and worker-side
    connectors (and SGLang's ranks when they share a process) must see the same index."""
    from flatcake_ray.node.store import FlatCakeStore

    root = options.get("store_root")
    if not root:
        raise ConfigError("store 'local' needs store_root (a folder for the store's files)")
    resolved = str(Path(str(root)).resolve())
    with _local_lock:
        known = _local_stores.get(resolved)
        if known is None:
            config = StoreConfig.from_env(
                root=resolved,
                layers=geometry.layers,
                page_bytes=geometry.page_bytes,
                **_store_fields(options),
            )
            known = _local_stores[resolved] = FlatCakeStore(config)
    _check_geometry(known, geometry)
    return known


def warm_up(store: KVStore) -> None:
    """``store.warm_up(peers=False)`` as an engine adapter starts (the Ray client maps its
    node's arena then, not in the first step; its connections to other nodes wait for the
    reads that need them, so an engine's start does not grow with the cluster). A store that
    cannot warm up now (a node gone since the client connected) does not stop the engine from
    starting: the first requests pay it, or miss and recompute, as without this call."""
    try:
        store.warm_up(peers=False)
    except FlatCakeError:
        logging.getLogger(__name__).warning(
            "FlatCake warm-up failed; the first requests pay it", exc_info=True
        )


def _check_geometry(store: KVStore, geometry: Geometry) -> None:
    found = Geometry(store.layers, store.page_bytes)
    if found != geometry:
        raise ConfigError(f"the store holds pages of {found}, this engine's pages are {geometry}")


def _open_ray(options: Mapping[str, Any], geometry: Geometry) -> KVStore:
    """``ray_namespace``, ``ray_address``, ``ray_allow`` reach the client; every other
    ``ray_<field>`` is a ClientConfig field (e.g. ``ray_restore_windows``)."""
    from flatcake_ray.client.client import FlatCakeClient
    from flatcake_ray.integrations import _ray_connect

    _ray_connect.connect(options)  # the engine's own cluster, never whichever "auto" finds
    given = {
        name[len("ray_") :]: value for name, value in options.items() if name.startswith("ray_")
    }
    connection = {k: given.pop(k) for k in ("namespace", "address", "allow") if k in given}
    client = FlatCakeClient(**connection, config=ClientConfig.from_env(**given))
    _check_geometry(client, geometry)
    return client


register_store_opener("local", _open_local)
register_store_opener("ray", _open_ray)


def close_local_stores() -> None:
    """Close every in-process store :func:`open_store` opened (tests; and at exit, so no
    DRAM arena outlives its process in /dev/shm)."""
    with _local_lock:
        stores = list(_local_stores.values())
        _local_stores.clear()
        for store in stores:
            _users.pop(id(store), None)
    for store in stores:
        store.close()


atexit.register(close_local_stores)


def option_flag(options: Mapping[str, Any], name: str, default: bool) -> bool:
    """A true/false adapter option (a bool, or its text as an engine's CLI JSON may give it)."""
    try:
        return bool(read_value("bool", options.get(name, default), text=True))
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}", name) from None


def option_size(options: Mapping[str, Any], name: str, default: int) -> int:
    """A byte size adapter option (an int, or text such as ``"4MiB"``)."""
    try:
        return parse_size(options.get(name, default))
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}", name) from None


def make_namespace(engine: str, *parts: object) -> str:
    """``engine/part/part``; a part holding ``/`` keeps it (model names do), empty parts drop."""
    return "/".join([engine, *(str(part) for part in parts if part not in (None, ""))])


def byte_view(tensor: Any) -> Any:
    """A uint8 view of a torch tensor whose last axis is contiguous (numpy has no bfloat16,
    and the store moves bytes, not numbers)."""
    import torch

    if tensor.dtype == torch.uint8:
        return tensor
    if tensor.stride(-1) != 1:
        raise ShapeError(f"a KV tensor's last axis must be contiguous, strides {tensor.stride()}")
    return tensor.view(torch.uint8)
