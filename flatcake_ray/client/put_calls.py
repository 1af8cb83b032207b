"""The client's puts, mixed into ``FlatCakeClient`` (which provides the attributes declared
below, ``layers``, ``page_bytes`` and ``_check_open``): a put goes a layer at a time
(:class:`~flatcake_ray.client.put.RemotePut`) to the node that owns its chain.

Apart from ``client.py`` because a put asks other questions than a read: which node takes it
(``client/owners.py``: where its chain or session already is, else where the coordinator
places a new scope; this client and the chain's homes then remember it for later lookups) and
which route reaches that node (shared memory, NIXL, or the object store as the counted last
resort). RemotePut moves the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from flatcake_ray.client.locate import Locator
from flatcake_ray.client.nodes import NodeTable
from flatcake_ray.client.owners import OwnerChooser
from flatcake_ray.client.put import PutRoute, RemotePut
from flatcake_ray.client.put_targets import PutTargets
from flatcake_ray.client.report import ClientTally, RestoreReport
from flatcake_ray.client.source import digests_of
from flatcake_ray.config import ServiceConfig
from flatcake_ray.core.api import PutResult
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.homes import anchor_of
from flatcake_ray.core.keys import KeyLike, PageKey, parent_digest
from flatcake_ray.errors import ShapeError
from flatcake_ray.media.buffers import as_page_bytes
from flatcake_ray.transports import base

__all__ = ["PutCalls"]

Keys = Sequence[KeyLike | PageKey]


class PutCalls:
    config: ServiceConfig
    nodes: NodeTable
    allowed: frozenset[str]
    tally: ClientTally
    _locator: Locator
    _owners: OwnerChooser
    _targets: PutTargets

    @property
    def layers(self) -> int:
        raise NotImplementedError

    @property
    def page_bytes(self) -> int:
        raise NotImplementedError

    def _check_open(self) -> None:
        raise NotImplementedError

    # ---- puts ------------------------------------------------------------------------------
    def begin_put(
        self,
        keys: Keys,
        *,
        namespace: str | None = None,
        session_id: str | None = None,
        parent: KeyLike | PageKey | None = None,
        hints: PutHints | None = None,
    ) -> RemotePut:
        """A put of ``keys`` a layer at a time on the session's node (see ``RemotePut``)."""
        digests = digests_of(keys, namespace)  # every key checked before any call
        return self._begin_put(
            keys, digests, namespace=namespace, session_id=session_id, parent=parent, hints=hints
        )

    def _begin_put(
        self,
        keys: Keys,
        digests: np.ndarray,
        *,
        namespace: str | None = None,
        session_id: str | None = None,
        parent: KeyLike | PageKey | None = None,
        hints: PutHints | None = None,
    ) -> RemotePut:
        """``begin_put`` of keys checked and hashed once (``digests``, one row a key)."""
        self._check_open()
        self._locator.settle_unawaited()  # this client's own leases keep nothing from eviction
        report = RestoreReport(len(keys))
        parent_packed = None if parent is None else parent_digest(keys, namespace, parent)
        link = self._owners.owner(anchor_of(digests), session_id, parent_packed, report)
        nixl = not link.local and base.REMOTE_DRAM_NIXL in link.available(self.allowed)
        if not link.local and not nixl:
            self.tally.count(puts_object_store_fallback=1)
        route = PutRoute(link, self.nodes, self._targets, nixl, self.config.rpc_timeout_s)
        options = dict(session_id=session_id, parent=parent_packed, hints=hints)
        continues = parent is not None
        self._owners.remember(digests, session_id, link.node_id, continues=continues, report=report)
        self.tally.count(puts=1, actor_calls=report.actor_calls)
        return RemotePut(
            route, digests, layers=self.layers, page_bytes=self.page_bytes, options=options
        )

    def put(self, keys: Keys, kv: Any, **options: Any) -> PutResult:
        """Store ``kv`` ([layers, len(keys), page_elems]) under ``keys`` on the session's node;
        pages already stored there are skipped (write-once). Raises ServiceError when the
        owner does not answer in time (it may still publish; a retry is safe: write-once)."""
        digests = digests_of(keys, options.get("namespace"))  # typed errors before the kv's
        pages, _ = as_page_bytes(
            kv, self.layers, self.page_bytes, min_pages=len(keys), writable=False, what="kv"
        )
        if pages.shape[1] != len(keys):
            raise ShapeError(f"kv holds {pages.shape[1]} pages for {len(keys)} keys")
        with self._begin_put(keys, digests, **options) as handle:
            for layer in range(self.layers):
                handle.write_layer(layer, pages[layer])
            return handle.commit()
