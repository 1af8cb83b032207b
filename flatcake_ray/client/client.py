"""FlatCakeClient: put, exists and get against the Ray service, from any process of the cluster.

Finding pages (no coordinator, O(nodes touched) calls): a session's pages live on the node the
coordinator placed its scope on, contiguous from the chain's first page. A request's first
key is looked up in a client-side location cache (first-page digest -> NodeID, filled by this
client's puts and earlier hits): on a hit the request is one ``lookup`` (index probe + lease)
on that node. On a miss (first request for a chain from this client, or the cached node lost
the pages) the client asks every live node once, in parallel, and keeps the longest prefix;
that is one round trip of N calls, then cached. Never one call per page, never the coordinator.

Reads: a lease pins the scopes for ``lease_ttl_s``; every part is routed purely by its GVA
(NodeID == this node's, MediaType) to a transport. A read that finishes after the lease could
have lapsed is dropped (miss), as is a part whose SSD checksum fails or whose transport fails:
misses, never wrong bytes. GVAs are immutable, so the location cache never needs invalidating
for correctness, only for efficiency.

Puts: the bytes go to the owner through a staging buffer, not the Ray object store: shared
memory the owner maps (same node) or a NIXL-registered buffer the owner READs (other node).
Only without NIXL do they ride in the call (labelled ``object-store-fallback``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from flatcake_ray.actors.protocol import COORDINATOR_NAME, StagedPages
from flatcake_ray.client.io import (
    DEFAULT_WINDOW_BYTES,
    PathTally,
    RestoreReport,
    StagingPool,
    check_key,
)
from flatcake_ray.client.locate import Locator, hits
from flatcake_ray.client.nodes import NodeLink, NodeTable
from flatcake_ray.client.read import LeaseReader
from flatcake_ray.config import ServiceConfig
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.keys import KeyLike, PageKey, digest_keys, split_namespace
from flatcake_ray.errors import (
    ServiceError,
    ShapeError,
)
from flatcake_ray.media.buffers import as_page_bytes
from flatcake_ray.node.put import PutResult
from flatcake_ray.transports import base

log = logging.getLogger(__name__)
Keys = Sequence[KeyLike | PageKey]
ALL_PATHS = frozenset(
    {
        base.REMOTE_DRAM_NIXL,
        base.REMOTE_DRAM_RDMA,
        base.REMOTE_SSD_NVMEOF,
        base.REMOTE_SSD_SHIPPED,
        base.OBJECT_STORE_FALLBACK,
    }
)
LEASE_MARGIN_S = 1.0


class FlatCakeClient:
    def __init__(
        self,
        namespace: str = "flatcake",
        *,
        address: str | None = None,
        allow: Iterable[str] | None = None,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
    ) -> None:
        """Connect to a running service. ``allow`` limits the remote paths (tests, benches)."""
        import ray

        if not ray.is_initialized():
            ray.init(address=address or "auto", namespace=namespace, log_to_driver=False)
        self.namespace = namespace
        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.allowed = frozenset(ALL_PATHS if allow is None else allow)
        unknown = self.allowed - ALL_PATHS
        if unknown:
            raise ValueError(f"unknown remote paths {sorted(unknown)}")
        self.window_bytes = window_bytes
        self.nodes = NodeTable(namespace, self.ray_node_id)
        self.nodes.refresh(force=True)
        if not self.nodes.links or self.nodes.config is None:
            raise ServiceError(
                f"no storage node answers in namespace {namespace!r}: run `flatcake-ray start`"
            )
        self.config: ServiceConfig = self.nodes.config
        self.layers, self.page_bytes = self.config.layers, self.config.page_bytes
        self._locator = Locator(self.nodes, self.config.rpc_timeout_s)
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._staging = StagingPool()
        self._agents: dict[str, Any] = {}
        self._reader = LeaseReader(
            self.nodes, self.layers, window_bytes, self.allowed, self._nixl_agent
        )
        self.paths: dict[str, PathTally] = {}
        self.counters = dict.fromkeys(
            ("puts", "gets", "exists", "hit_pages", "miss_pages", "actor_calls"), 0
        )
        self.counters.update(
            dict.fromkeys(("lease_expired", "read_failures", "puts_object_store_fallback"), 0)
        )

    def warm_up(self) -> frozenset[str]:
        """Pay the one-time costs now rather than in the first request: probe the remote
        paths (importing NIXL imports torch: seconds), start this client's NIXL agent and
        connect the remote-DRAM transport of every node. Returns the paths probed usable."""
        from flatcake_ray.client.nodes import process_paths

        usable = process_paths()
        for link in self.nodes.up():
            if base.REMOTE_DRAM_NIXL in link.available(self.allowed):
                link.transport(base.REMOTE_DRAM_NIXL, Medium.DRAM, self._nixl_agent)
        return usable

    # ---- plumbing --------------------------------------------------------------------------
    def _nixl_agent(self, role: str) -> Any:
        """This client's reading agent for ``role`` ("arena" or "ship"): one per role, since
        a node exports both from one agent and a peer is added once per agent."""
        with self._lock:
            if role not in self._agents:
                from flatcake_ray.actors.nixl_roles import reader_agent
                from flatcake_ray.transports.nixl_dram import unique_agent_name

                self._agents[role] = reader_agent(unique_agent_name(f"fc-client-{role}"))
            return self._agents[role]

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self.counters[name] += delta

    def _first_digest(self, keys: Keys, namespace: str | None) -> bytes:
        """Check every key here (before any call) and digest the first: the location key."""
        if len(keys) == 0:
            raise ShapeError("a call needs at least one key")
        resolved, bare = split_namespace(keys, namespace)
        for key in bare:
            check_key(key)
        return digest_keys(resolved, bare[:1]).tobytes()

    # ---- exists / get ----------------------------------------------------------------------
    def exists(self, keys: Keys, *, namespace: str | None = None) -> int:
        """How many consecutive pages from the first are stored (on one node)."""
        first = self._first_digest(keys, namespace)
        report = RestoreReport(len(keys))
        _, answer = self._locator.ask("exists", list(keys), namespace, first, report)
        self._count(exists=1, actor_calls=report.actor_calls)
        return hits(answer)

    def gvas(self, keys: Keys, *, namespace: str | None = None) -> np.ndarray:
        """The layer-0 GVA of each consecutive hit, from the node holding them. GVAs are
        immutable, so callers may keep them; reads still take a lease (a reclaimed scope is
        a miss then, never wrong bytes)."""
        import ray

        first = self._first_digest(keys, namespace)
        report = RestoreReport(len(keys))
        link, found = self._locator.ask("exists", list(keys), namespace, first, report)
        if link is None or not found:
            return np.zeros(0, dtype=np.uint64)
        ref = link.handle.gvas.remote(list(keys), namespace)
        return ray.get(ref, timeout=self.config.rpc_timeout_s)

    def locate(
        self, keys: Keys, *, namespace: str | None = None, lease: bool = False
    ) -> RestoreReport:
        """The control-plane half of a restore, no bytes moved: which node holds the prefix
        (``node_id``) and how long it is (``pages``); with ``lease`` the lease is taken and
        released as a restore would. Its calls and time are in the report."""
        report = RestoreReport(len(keys))
        first = self._first_digest(keys, namespace)
        started = time.monotonic()
        link, answer = self._locator.ask(
            "lookup" if lease else "exists", list(keys), namespace, first, report
        )
        if lease and link is not None and answer is not None and answer.hits:
            self._locator.release(link, answer, (), report)
        report.control_seconds = time.monotonic() - started
        report.node_id = None if link is None or not hits(answer) else link.node_id
        report.pages = hits(answer)
        return report

    def forget_locations(self) -> None:
        """Drop the location cache (the next request of each chain asks every node)."""
        self._locator.forget()

    def get(self, keys: Keys, out: Any, *, namespace: str | None = None) -> int:
        """Restore the consecutive hits into ``out`` ([layers, >= len(keys), page_elems];
        numpy, torch CPU or CUDA); returns how many pages from the first are valid."""
        return self.restore(keys, out, namespace=namespace).pages

    def restore(self, keys: Keys, out: Any, *, namespace: str | None = None) -> RestoreReport:
        """``get`` with its report: pages, the path that served each part, calls, times."""
        view, finish = as_page_bytes(
            out, self.layers, self.page_bytes, min_pages=len(keys), writable=True, what="out"
        )
        first = self._first_digest(keys, namespace)
        report = RestoreReport(len(keys))
        started = time.monotonic()
        link, reply = self._locator.ask("lookup", list(keys), namespace, first, report)
        report.control_seconds = time.monotonic() - started
        if link is not None and reply is not None and reply.hits:
            report.node_id = link.node_id
            bad_scopes: set[int] = set()
            try:
                bad_scopes = self._reader.read(link, reply, view, report)
            finally:
                self._locator.release(link, reply, bad_scopes, report)
            if time.monotonic() - started > self.config.lease_ttl_s - LEASE_MARGIN_S:
                report.lease_expired, report.pages = True, 0  # the owner may have let go
            finish()
        self._account(report)
        return report

    def _account(self, report: RestoreReport) -> None:
        with self._lock:
            self.counters["gets"] += 1
            self.counters["hit_pages"] += report.pages
            self.counters["miss_pages"] += report.requested - report.pages
            self.counters["actor_calls"] += report.actor_calls
            self.counters["lease_expired"] += int(report.lease_expired)
            self.counters["read_failures"] += len(report.failures)
            for path, tally in report.paths.items():
                self.paths.setdefault(path, PathTally()).merge(tally)

    # ---- puts ------------------------------------------------------------------------------
    def put(
        self,
        keys: Keys,
        kv: Any,
        *,
        namespace: str | None = None,
        session_id: str | None = None,
        parent: KeyLike | PageKey | None = None,
        hints: PutHints | None = None,
    ) -> PutResult:
        """Store ``kv`` ([layers, len(keys), page_elems]) under ``keys`` on the session's node;
        pages already stored there are skipped (write-once). Raises ServiceError when the
        owner does not answer in time (it may still publish; a retry is safe: write-once)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        first = self._first_digest(keys, namespace)
        pages, _ = as_page_bytes(
            kv, self.layers, self.page_bytes, min_pages=len(keys), writable=False, what="kv"
        )
        if pages.shape[1] != len(keys):
            raise ShapeError(f"kv holds {pages.shape[1]} pages for {len(keys)} keys")
        report = RestoreReport(len(keys))
        link = self._owner_for_put(first, namespace, session_id, parent, report)
        buffer = self._staging.acquire()
        try:
            staged = self._stage(link, pages, buffer)
            ref = link.handle.put_staged.remote(
                list(keys), staged, namespace, session_id, parent, hints
            )
            # A big put takes longer: allow it at least 200 MB/s on top of the RPC timeout.
            timeout = self.config.rpc_timeout_s + pages.nbytes / 200e6
            result = ray.get(ref, timeout=timeout)
        except (RayActorError, GetTimeoutError) as exc:
            self.nodes.mark_down(link, f"put failed: {exc}")
            raise ServiceError(f"storage node {link.node_id} did not take the put: {exc}") from exc
        finally:
            self._staging.release(buffer)
        self._locator.remember(first, link.node_id)
        if session_id is not None:
            self._sessions[session_id] = link.node_id
        self._count(puts=1, actor_calls=report.actor_calls + 1)
        return result

    def _stage(self, link: NodeLink, pages: np.ndarray, buffer: Any) -> StagedPages:
        layers, count, page_bytes = pages.shape
        geometry = {"layers": layers, "pages": count, "page_bytes": page_bytes}
        if not link.local and base.REMOTE_DRAM_NIXL not in link.available(self.allowed):
            self._count(puts_object_store_fallback=1)
            return StagedPages("inline", **geometry, inline=np.ascontiguousarray(pages))
        shared = buffer.ensure(pages.nbytes)
        shared.view[: pages.nbytes] = pages.reshape(-1)
        common = {"path": shared.path, "token": shared.token, "buffer_bytes": shared.nbytes}
        common.update(geometry)
        if link.local:
            return StagedPages("shm", **common)
        return StagedPages("nixl", peer=buffer.peer(), **common)

    def _owner_for_put(
        self,
        first: bytes,
        namespace: str | None,
        session_id: str | None,
        parent: Any,
        report: RestoreReport,
    ) -> NodeLink:
        now = time.monotonic()
        self.nodes.refresh()  # a drained node stops taking this client's sessions too
        known = self._sessions.get(session_id) if session_id is not None else None
        if known is None and session_id is None:
            if parent is not None:  # continue the chain where its parent is
                parent_first = self._first_digest([parent], namespace)
                holder, found = self._locator.ask(
                    "exists", [parent], namespace, parent_first, report
                )
                known = holder.node_id if holder is not None and found else None
            else:
                known = self._locator.where(first)
        link = self.nodes.get(known) if known is not None else None
        # A drained node takes no new chain; a chain's tail stays beside its head (the tail
        # alone is never a prefix hit) until the node is removed.
        placeable = parent is not None or known not in self.nodes.drained
        if link is not None and link.is_up(now) and placeable:
            return link
        return self._placed(session_id, report)

    def _placed(self, session_id: str | None, report: RestoreReport) -> NodeLink:
        """A new scope: where the coordinator puts it; if it is down, a node every client
        picks alike for this session (or, with no session, this node)."""
        import ray
        from ray.exceptions import RayError

        self.nodes.refresh()
        try:
            coordinator = ray.get_actor(COORDINATOR_NAME, namespace=self.namespace)
            report.actor_calls += 1
            ref = coordinator.place_scope.remote(session_id)
            node_id = ray.get(ref, timeout=self.config.rpc_timeout_s)
            if self.nodes.get(node_id) is None:  # a node that joined since the last refresh
                self.nodes.refresh(force=True)
            link = self.nodes.get(node_id)
            if link is not None and link.is_up(time.monotonic()):
                return link
        except (RayError, ValueError, ServiceError) as exc:
            log.warning("coordinator unavailable for placement (%s); placing locally", exc)
        up = [link for link in self.nodes.up() if link.node_id not in self.nodes.drained]
        if not up:
            raise ServiceError("no undrained storage node is up")
        up.sort(key=lambda link: link.node_id)
        if session_id is not None:
            # The same choice in every client (a stable hash), so concurrent writers of one
            # session still meet on one node while the coordinator is away.
            return up[zlib.crc32(session_id.encode()) % len(up)]
        local = [link for link in up if link.local]
        return local[0] if local else up[0]

    # ---- async forms -----------------------------------------------------------------------
    async def aput(self, keys: Keys, kv: Any, **options: Any) -> PutResult:
        return await asyncio.to_thread(self.put, keys, kv, **options)

    async def aexists(self, keys: Keys, **options: Any) -> int:
        return await asyncio.to_thread(self.exists, keys, **options)

    async def aget(self, keys: Keys, out: Any, **options: Any) -> int:
        return await asyncio.to_thread(self.get, keys, out, **options)

    async def arestore(self, keys: Keys, out: Any, **options: Any) -> RestoreReport:
        return await asyncio.to_thread(self.restore, keys, out, **options)

    # ---- stats and lifecycle ---------------------------------------------------------------
    def stats(self, *, nodes: bool = True) -> dict[str, Any]:
        """This client's counters and per-path tallies; with ``nodes``, each node's stats
        (one call per node: control plane, not for the serving loop)."""
        import ray
        from ray.exceptions import RayError

        with self._lock:
            out: dict[str, Any] = {
                "client": {**self.counters, "fanouts": self._locator.fanouts},
                "paths": {p: vars(t).copy() for p, t in self.paths.items()},
                "local_node_id": self.nodes.local_node_id,
            }
        if nodes:
            links = self.nodes.up()
            refs = [link.handle.stats.remote() for link in links]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.rpc_timeout_s)
            out["nodes"] = {}
            for link, ref in zip(links, refs, strict=True):
                if ref not in ready:
                    continue
                try:
                    out["nodes"][link.node_id] = ray.get(ref)
                except RayError as exc:
                    self.nodes.mark_down(link, f"stats failed: {exc}")
        return out

    def close(self) -> None:
        self._reader.close()
        self.nodes.close()
        self._staging.close()
        for agent in self._agents.values():
            agent.close()
        self._agents.clear()

    def __enter__(self) -> FlatCakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
