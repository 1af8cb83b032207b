"""What the engine adapters share: how to reach a store, namespaces, probes, byte views.

An adapter never builds a store itself: it calls :func:`open_store` with the options the engine
was configured with (``kv_connector_extra_config`` in vLLM, the HiCache extra config in
SGLang). ``store: local`` opens an in-process :class:`FlatCakeStore` (tests, one-box
serving); ``store: ray`` attaches to a running FlatCake-Ray service. Another way to reach a
store is one :func:`register_store_opener` call away.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from flatcake_ray.config import StoreConfig, parse_size
from flatcake_ray.core.gva import SSD_FLOOR
from flatcake_ray.errors import ConfigError, ShapeError

# Keys that steer the adapter itself; every other ``store_*`` option is a StoreConfig field.
STORE_KIND = "store"
STORE_PREFIX = "store_"


class KVStore(Protocol):
    """The store API the adapters use; FlatCakeStore and the Ray client both provide it.
    ``begin_put`` (layer at a time) and ``gvas`` (hit media) are used where a store has them."""

    def put(self, keys: Sequence[Any], kv: Any, **options: Any) -> Any: ...
    def exists(self, keys: Sequence[Any], *, namespace: str | None = None) -> int: ...
    def get(self, keys: Sequence[Any], out: Any, *, namespace: str | None = None) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Geometry:
    """What the engine's KV looks like to the store: layers and bytes of one layer's page."""

    layers: int
    page_bytes: int


StoreOpener = Callable[[Mapping[str, Any], Geometry], KVStore]

_openers: dict[str, StoreOpener] = {}
_local_stores: dict[str, KVStore] = {}
_local_locks: dict[str, int] = {}  # root -> fd holding the root's flock
_local_users: dict[str, int] = {}  # root -> adapters holding its store (release_store)
LOCK_NAME = ".flatcake-local.lock"
_local_lock = threading.Lock()


def register_store_opener(kind: str, opener: StoreOpener) -> None:
    """Make ``{"store": kind, ...}`` reach a store through ``opener(options, geometry)``."""
    _openers[kind] = opener


def open_store(options: Mapping[str, Any], geometry: Geometry) -> KVStore:
    kind = str(options.get(STORE_KIND, "local"))
    opener = _openers.get(kind)
    if opener is None:
        raise ConfigError(f"unknown store kind {kind!r}; known: {sorted(_openers)}")
    return opener(options, geometry)


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
        store = _local_stores.get(resolved)
        if store is None:
            _lock_root(resolved)
            config = StoreConfig.from_env(
                root=resolved,
                layers=geometry.layers,
                page_bytes=geometry.page_bytes,
                **_store_fields(options),
            )
            store = FlatCakeStore(config)
            _local_stores[resolved] = store
        _local_users[resolved] = _local_users.get(resolved, 0) + 1
    _check_geometry(store, geometry)
    return store


def _lock_root(root: str) -> None:
    """Two processes must never run stores on one root (each would allocate the same SSD
    extents). vLLM runs its scheduler and workers in separate processes unless told not to,
    so a multi-process engine needs ``store: ray``; this says so instead of corrupting."""
    Path(root).mkdir(parents=True, exist_ok=True)
    fd = os.open(os.path.join(root, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise ConfigError(
            f"store root {root} is in use by another process; an engine whose scheduler and "
            "workers run in separate processes reaches one store with store: ray"
        ) from exc
    _local_locks[root] = fd


def _check_geometry(store: KVStore, geometry: Geometry) -> None:
    config = getattr(store, "config", None)
    if config is None:
        return
    found = Geometry(config.layers, config.page_bytes)
    if found != geometry:
        raise ConfigError(f"the store holds pages of {found}, this engine's pages are {geometry}")


def _open_ray(options: Mapping[str, Any], geometry: Geometry) -> KVStore:
    from flatcake_ray.client.client import FlatCakeClient  # type: ignore[import-not-found]
    from flatcake_ray.integrations import _ray_connect

    _ray_connect.connect(options)  # the engine's own cluster, never whichever "auto" finds
    client_options = {
        name[len("ray_") :]: value for name, value in options.items() if name.startswith("ray_")
    }
    client = FlatCakeClient(**client_options)
    _check_geometry(client, geometry)
    return client


register_store_opener("local", _open_local)
register_store_opener("ray", _open_ray)


def release_store(store: KVStore) -> None:
    """An adapter is done with a store :func:`open_store` gave it: an in-process store closes
    (its DRAM arena leaves /dev/shm) when the last adapter of this process releases it, any
    other store (a Ray client) closes at once."""
    lock = None
    with _local_lock:
        root = next((r for r, s in _local_stores.items() if s is store), None)
        if root is not None:
            _local_users[root] -= 1
            if _local_users[root] > 0:
                return
            del _local_stores[root], _local_users[root]
            lock = _local_locks.pop(root, None)
    store.close()
    if lock is not None:
        os.close(lock)  # after the close: another process may take the root from here on


def close_local_stores() -> None:
    """Close every in-process store :func:`open_store` opened (tests, shutdown, exit)."""
    with _local_lock:
        stores = list(_local_stores.values())
        locks = list(_local_locks.values())
        _local_stores.clear()
        _local_locks.clear()
        _local_users.clear()
    for store in stores:
        store.close()
    for fd in locks:
        os.close(fd)  # closing the descriptor releases its flock


# An engine process that exits without shutting its adapters down still removes its arena.
atexit.register(close_local_stores)


def make_namespace(engine: str, *parts: object) -> str:
    """``engine/part/part``; a part holding ``/`` keeps it (model names do), empty parts drop."""
    return "/".join([engine, *(str(part) for part in parts if part not in (None, ""))])


@dataclass(frozen=True)
class Probe:
    """Consecutive hits from the first key, and whether any of them lies on SSD."""

    hits: int
    on_ssd: bool


def probe_prefix(store: KVStore, keys: Sequence[Any], namespace: str) -> Probe:
    """Hits and their slowest medium in one call where the store can tell (``gvas``: an SSD
    GVA is at or above ``1 << 60``); a store that cannot is read as all-DRAM, which only
    costs a synchronous load where an asynchronous one would have hidden SSD latency."""
    if not keys:
        return Probe(0, False)
    gvas = getattr(store, "gvas", None)
    if gvas is None:
        return Probe(store.exists(keys, namespace=namespace), False)
    found = gvas(keys, namespace=namespace)
    return Probe(len(found), bool(len(found)) and int(max(found)) >= SSD_FLOOR)


def byte_view(tensor: Any) -> Any:
    """A uint8 view of a torch tensor whose last axis is contiguous (numpy has no bfloat16,
    and the store moves bytes, not numbers)."""
    import torch

    if tensor.dtype == torch.uint8:
        return tensor
    if tensor.stride(-1) != 1:
        raise ShapeError(f"a KV tensor's last axis must be contiguous, strides {tensor.stride()}")
    return tensor.view(torch.uint8)


class BufferedPut:
    """``begin_put`` for a store that only has ``put`` (the Ray client): layers collect in
    host memory, one ``put`` sends them at commit."""

    def __init__(self, store: KVStore, keys: Sequence[Any], geometry: Geometry, options: dict):
        import torch

        self._store = store
        self._keys = list(keys)
        self._options = options
        self._pages = torch.empty(
            (geometry.layers, len(keys), geometry.page_bytes), dtype=torch.uint8
        )
        self._written: set[int] = set()

    def write_layer(self, layer: int, pages: Any) -> None:
        self._pages[layer] = pages.reshape(self._pages.shape[1:])
        self._written.add(layer)

    def commit(self) -> Any:
        missing = sorted(set(range(self._pages.shape[0])) - self._written)
        if missing:
            raise ShapeError(f"commit before layers {missing[:8]} were written")
        return self._store.put(self._keys, self._pages, **self._options)

    def abort(self) -> None:
        self._written.clear()


def begin_put(store: KVStore, keys: Sequence[Any], geometry: Geometry, **options: Any) -> Any:
    """A layer-at-a-time put on any store: its own ``begin_put`` where it has one."""
    if hasattr(store, "begin_put"):
        return store.begin_put(list(keys), **options)
    return BufferedPut(store, keys, geometry, options)
