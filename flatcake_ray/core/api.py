"""The store contract, stated once: what every store gives the engine adapters.

Both :class:`~flatcake_ray.node.store.FlatCakeStore` (in process) and
:class:`~flatcake_ray.client.client.FlatCakeClient` (the Ray service) satisfy :class:`KVStore`;
the vLLM connector and the SGLang backend program against it and nothing else.

Who calls what:

- The engine's scheduler side: ``probe(keys)`` (how many consecutive pages from the first are
  stored, and whether any lies on SSD: an SSD hit is loaded asynchronously) or ``exists``.
  ``probe(keys, lease=True)`` also leases the hits where a store's lookups are calls (the Ray
  service): ``Probe.grant``, which the process that loads hands to ``restore(grant=)`` (the
  same keys, in the same namespace) or gives back with ``let_go(grant)``; each grant is used
  or let go exactly once. A store whose lookups are local hands out none (``grant`` None).
- The engine's worker side, to load: ``restore(keys, dest)`` returns a :class:`RestoreWaiter`
  at once; ``wait_for_layer(l)`` before layer ``l``'s attention, ``wait()`` for all of it.
  ``get(keys, out)`` is ``restore(...).wait()`` into a ``[layers, pages, page_elems]`` buffer.
- The worker side, to save: ``begin_put(keys)`` returns a :class:`PutWriter`; ``write_layer``
  each layer once, as the forward pass finishes it, then ``commit`` (keys are published only
  after the last layer landed) or ``abort`` (space given back, nothing published). ``put``
  is the same for a buffer holding every layer.
- Anyone: ``stats()``; the owner of the store: ``close()``.

Every call raises typed errors from ``flatcake_ray.errors``; a rejected call changes nothing
already stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.keys import KeyLike, PageKey
from flatcake_ray.core.records import SessionId

Keys = Sequence[KeyLike | PageKey]


@dataclass(frozen=True)
class PutResult:
    pages_written: int
    pages_skipped: int  # already stored (write-once)
    medium: Medium | None  # None when nothing was written
    rule: str | None  # the placement rule that chose the medium
    session_id: SessionId | None


@dataclass(frozen=True)
class Probe:
    """Consecutive hits from the first key, and whether reading them touches SSD (a page
    that also has a DRAM read replica is read from DRAM, so it does not)."""

    hits: int
    on_ssd: bool
    grant: Any = None  # the hits' lease, when asked for and the store hands one out


class RestoreWaiter(Protocol):
    @property
    def hits(self) -> int: ...
    @property
    def pages(self) -> int: ...
    @property
    def done(self) -> bool: ...
    def wait_for_layer(self, layer: int, timeout: float | None = None) -> int: ...
    def wait(self, timeout: float | None = None) -> int: ...


class PutWriter(Protocol):
    @property
    def pages_new(self) -> int: ...
    def write_layer(self, layer: int, pages: Any) -> None: ...
    def commit(self) -> PutResult: ...
    def abort(self) -> None: ...
    def __enter__(self) -> PutWriter: ...
    def __exit__(self, *exc: object) -> None: ...


class KVStore(Protocol):
    """See the module docstring. ``dest`` of ``restore`` is a restore destination
    (``flatcake_ray.restore.dest``: ``LayerTensors``, ``PagedPool``) or a pool with
    ``slot_ids`` and ``layout``."""

    @property
    def layers(self) -> int: ...
    @property
    def page_bytes(self) -> int: ...
    def exists(self, keys: Keys, *, namespace: str | None = None) -> int: ...
    def probe(self, keys: Keys, *, namespace: str | None = None, lease: bool = False) -> Probe: ...
    def restore(
        self,
        keys: Keys,
        dest: Any,
        slot_ids: Any = None,
        layout: Any = "layer_first",
        *,
        namespace: str | None = None,
        grant: Any = None,
    ) -> RestoreWaiter: ...
    def let_go(self, grant: Any) -> None: ...
    def get(self, keys: Keys, out: Any, *, namespace: str | None = None) -> int: ...
    def begin_put(
        self,
        keys: Keys,
        *,
        namespace: str | None = None,
        session_id: str | None = None,
        parent: KeyLike | PageKey | None = None,
        hints: PutHints | None = None,
    ) -> PutWriter: ...
    def put(self, keys: Keys, kv: Any, **options: Any) -> PutResult: ...
    # One-time costs paid now, not in the first request (an engine's adapter calls it as it
    # starts, with ``peers=False``): the Ray client probes its paths and maps its node's
    # arena, and with ``peers`` connects to every node; in process, nothing is left to pay.
    def warm_up(self, *, peers: bool = True) -> object: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...
