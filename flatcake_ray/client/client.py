"""FlatCakeClient: the Ray service as a :class:`~flatcake_ray.core.api.KVStore`, from any
process of the cluster.

Finding pages (no coordinator, a bounded number of calls at any cluster size): a session's
pages live on the node the coordinator placed its scope on, contiguous from the chain's first
page. A request's first key is looked up in a client-side location cache (first-page digest
-> NodeID, filled by this client's puts and earlier hits): on a hit the request is one
``lookup`` (index probe + lease) on that node. Otherwise the chain's two homes are asked in
parallel and, if they only know the owner, the owner: a miss is 2 calls, a hit at most 3
(``client/locate.py``). Never one call per page, never one per node.

Restores run through the same :class:`RestorePipeline` as the in-process store (bounded
staging windows, layer order and per-layer waits, FC-MAS admission, the scatter step), over
:class:`~flatcake_ray.client.source.TransportSource`: every part routed purely by its GVA to
a transport. A read that finishes after the lease could have lapsed is dropped (miss), as is
a chunk whose checksum fails or whose transport fails: misses, never wrong bytes.

Puts go layer by layer (:class:`~flatcake_ray.client.put.RemotePut`) to the owner's put
handle, through shared memory (same node) or NIXL (other node), never the Ray object store
unless nothing else reaches the owner (labelled ``object-store-fallback``); the put calls are
:class:`~flatcake_ray.client.put_calls.PutCalls` (mixed in, ``client/put_calls.py``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from flatcake_ray.client.locate import Locator, hits
from flatcake_ray.client.nodes import NodeTable, process_paths
from flatcake_ray.client.owners import OwnerChooser
from flatcake_ray.client.put_calls import PutCalls
from flatcake_ray.client.put_targets import PutTargets
from flatcake_ray.client.report import ClientTally, RestoreReport
from flatcake_ray.client.source import HeldLease, TransportSource, digests_of, probe_of
from flatcake_ray.client.staging import StagingArena
from flatcake_ray.config import ClientConfig, ServiceConfig
from flatcake_ray.core.api import Probe, PutResult
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.keys import KeyLike, PageKey, check_key_list
from flatcake_ray.core.tenants import seal_key
from flatcake_ray.cuda_ext.scatter import LAYER_FIRST, Layout
from flatcake_ray.errors import ServiceError, ShapeError, StoreClosedError
from flatcake_ray.metrics.record import Metrics
from flatcake_ray.restore.dest import PagedPool, as_destination
from flatcake_ray.restore.handle import RestoreHandle
from flatcake_ray.restore.pipeline import RestorePipeline
from flatcake_ray.restore.source import ReadOutcome
from flatcake_ray.transports import base
from flatcake_ray.transports.local_ssd import gds_wanted

Keys = Sequence[KeyLike | PageKey]


class FlatCakeClient(PutCalls):
    def __init__(
        self,
        namespace: str = "flatcake",
        *,
        address: str | None = None,
        allow: Iterable[str] | None = None,
        config: ClientConfig | None = None,
    ) -> None:
        """Connect to a running service. ``allow`` limits the remote paths (tests, benches)."""
        import ray

        if not ray.is_initialized():
            ray.init(address=address or "auto", namespace=namespace, log_to_driver=False)
        self.namespace = namespace
        self.client_config = config or ClientConfig.from_env()
        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.allowed = frozenset(base.ALLOWABLE_PATHS if allow is None else allow)
        if self.allowed - base.ALLOWABLE_PATHS:
            raise ValueError(f"unknown remote paths {sorted(self.allowed - base.ALLOWABLE_PATHS)}")
        secret = self.client_config.tenant_secret or None
        config = self.client_config
        self.nodes = NodeTable(
            namespace,
            self.ray_node_id,
            secret,
            direct_calls=config.direct_calls,
            remote_direct_calls=config.remote_direct_calls,
        )
        self.nodes.refresh(force=True)
        if not self.nodes.links or self.nodes.config is None:
            raise ServiceError(
                f"no storage node answers in namespace {namespace!r}: run `flatcake-ray start`"
            )
        self.config: ServiceConfig = self.nodes.config
        described = next(iter(self.nodes.links.values())).description
        self.tenant = described.tenant
        self._geometry = (described.layers, described.page_bytes)  # the tenant's model
        self._locator = Locator(self.nodes, self.config.rpc_timeout_s)
        self._owners = OwnerChooser(self.nodes, self._locator, namespace, self.config.rpc_timeout_s)
        self._lock = threading.Lock()
        self._closed = False
        self._agents: dict[str, Any] = {}
        self._staging = StagingArena(self.client_config.staging_segment_bytes)
        self._targets = PutTargets(self._staging, self.config.rpc_timeout_s)
        self.source = TransportSource(
            self.nodes,
            self._locator,
            layers=self.layers,
            page_bytes=self.page_bytes,
            allowed=self.allowed,
            agents=self._nixl_agent,
            lease_ttl_s=self.config.lease_ttl_s,
            gds=gds_wanted(self.client_config.gds),
            on_release=self._account,
            seal_key=seal_key(secret) if secret else None,
        )
        self._pipelines: dict[torch.device, RestorePipeline] = {}
        self.tally = ClientTally()
        self.metrics = Metrics(node_id=None, page_tokens=self.client_config.page_tokens)

    @property
    def layers(self) -> int:
        return self._geometry[0]

    @property
    def page_bytes(self) -> int:
        return self._geometry[1]

    def warm_up(self, *, peers: bool = True) -> frozenset[str]:
        """Pay the one-time costs now rather than in the first request: probe the remote
        paths (importing NIXL imports torch: seconds); on this client's own node, map the
        arena chunks its tenant holds for reads and for puts (a put's first write into a
        chunk this process never mapped paid its page tables: 1.2 GB of 4 KiB pages, 70-140
        ms); with ``peers``, also start this client's NIXL agent and connect the remote-DRAM
        transport of every node (a connection a node: an engine's adapter leaves them to its
        first reads, so its start does not grow with the cluster). Returns the paths probed
        usable."""
        usable = process_paths()
        for link in self.nodes.up():
            if peers and base.REMOTE_DRAM_NIXL in link.available(self.allowed):
                link.transport(base.REMOTE_DRAM_NIXL, Medium.DRAM, self._nixl_agent)
            if link.local:  # local paths are always taken (no "allow" names them)
                link.transport(base.LOCAL_DRAM, Medium.DRAM, self._nixl_agent)
                self._targets.premap(link, link.hand_chunks("arena"))
        return usable

    # ---- plumbing --------------------------------------------------------------------------
    def _nixl_agent(self, role: str) -> Any:
        """This client's reading agent for ``role`` ("arena" or "ship"): one per role, since
        a node exports both from one agent and a peer is added once per agent."""
        with self._lock:
            if role not in self._agents:
                from flatcake_ray.actors.nixl_roles import reader_agent
                from flatcake_ray.transports.nixl_agent import unique_agent_name

                self._agents[role] = reader_agent(unique_agent_name(f"fc-client-{role}"))
            return self._agents[role]

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the client is closed")

    # ---- lookups ---------------------------------------------------------------------------
    def exists(self, keys: Keys, *, namespace: str | None = None) -> int:
        """How many consecutive pages from the first are stored (on one node)."""
        return self.probe(keys, namespace=namespace).hits

    def probe(self, keys: Keys, *, namespace: str | None = None, lease: bool = False) -> Probe:
        """Consecutive hits from the first key and whether reading them touches SSD (one
        call); with ``lease`` the hits are leased in that call, the lease handed back as
        ``Probe.grant`` for ``restore(grant=)`` (here or in another process) or ``let_go``."""
        self._check_open()
        digests = digests_of(keys, namespace)  # typed errors first: keys may be anything
        report = RestoreReport(len(keys))
        link, answer = self._locator.ask("lookup" if lease else "probe", digests, report)
        self.tally.count(exists=1, actor_calls=report.actor_calls)
        probe = probe_of(answer, digests)
        node_id = None if link is None else link.node_id
        self.metrics.probed(self.tenant, len(keys), probe.hits, node_id)
        return probe

    def gvas(self, keys: Keys, *, namespace: str | None = None) -> np.ndarray:
        """The layer-0 GVA of each consecutive hit, from the node holding them. GVAs are
        immutable, so callers may keep them; reads still take a lease (a reclaimed scope is
        a miss then, never wrong bytes)."""
        import ray

        digests = digests_of(keys, namespace)
        report = RestoreReport(len(keys))
        link, found = self._locator.ask("exists", digests, report)
        if link is None or not found:
            return np.zeros(0, dtype=np.uint64)
        ref = link.handle.gvas.remote(digests)
        return ray.get(ref, timeout=self.config.rpc_timeout_s)

    def locate(
        self, keys: Keys, *, namespace: str | None = None, lease: bool = False
    ) -> RestoreReport:
        """The control-plane half of a restore, no bytes moved: which node holds the prefix
        (``node_id``) and how long it is (``pages``); with ``lease`` the lease is taken as a
        restore takes it and let go of unread: its release rides on the next ``lookup`` to
        that node (``Locator.let_go``), so a warm locate is one call. Its calls and time are
        in the report."""
        report = RestoreReport(len(keys))
        started = time.monotonic()
        digests = digests_of(keys, namespace)
        method = "lookup" if lease else "exists"
        link, answer = self._locator.ask(method, digests, report)
        if lease and link is not None and answer is not None and answer.hits:
            self._locator.let_go(link, answer)  # no answer wanted: the next lookup carries it
        report.control_seconds = time.monotonic() - started
        report.node_id = None if link is None or not hits(answer) else link.node_id
        report.pages = hits(answer)
        return report

    def forget_locations(self) -> None:
        """Drop the location cache (the next request of each chain asks its homes)."""
        self._locator.forget()

    # ---- restores --------------------------------------------------------------------------
    def pipeline(self, device: str | torch.device = "cpu") -> RestorePipeline:
        """This client's restore pipeline for destinations on ``device`` (made on first use)."""
        key = torch.device(device)
        with self._lock:
            self._check_open()
            if key not in self._pipelines:
                self._pipelines[key] = RestorePipeline(
                    self.source,
                    windows=self.client_config.restore_windows,
                    slot_bytes=self.client_config.restore_slot_bytes,
                    device=key,
                )
            return self._pipelines[key]

    def restore(
        self,
        keys: Keys,
        dest: Any,
        slot_ids: Any = None,
        layout: Layout = LAYER_FIRST,
        *,
        namespace: str | None = None,
        grant: Any = None,
    ) -> RestoreHandle:
        """Start a layer-pipelined restore of ``keys`` into ``dest`` (see ``RestorePipeline``);
        ``handle.lease.token.report`` is its :class:`RestoreReport` once it is done. Under
        ``grant`` (``probe(lease=True)`` of these keys) the restore asks no node first."""
        destination = as_destination(dest, slot_ids, layout)
        pipeline = self.pipeline(destination.device)
        return pipeline.submit(keys, destination, namespace=namespace, grant=grant)

    def let_go(self, grant: Any) -> None:
        """Give back a ``probe(lease=True)`` grant that no restore will read under."""
        self.source.let_go(grant)

    def restore_report(
        self, keys: Keys, out: Any, *, namespace: str | None = None
    ) -> RestoreReport:
        """``get`` with its report: pages, the path that served each part, calls, times."""
        check_key_list(keys)
        if len(keys) == 0:
            raise ShapeError("a call needs at least one key")
        pool = PagedPool(out, np.arange(len(keys)), LAYER_FIRST)
        handle = self.pipeline(pool.device).submit(keys, pool, namespace=namespace)
        handle.wait()
        return handle.lease.token.report

    def get(self, keys: Keys, out: Any, *, namespace: str | None = None) -> int:
        """Restore the consecutive hits into ``out`` ([layers, >= len(keys), page_elems];
        numpy, torch CPU or CUDA); returns how many pages from the first are valid."""
        return self.restore_report(keys, out, namespace=namespace).pages

    def _account(self, held: HeldLease, outcome: ReadOutcome, pages: int) -> None:
        """A restore ended (TransportSource.release): finish its report, count it."""
        self.tally.restore_ended(held.report, outcome, pages)
        parts = () if held.reply is None else held.reply.parts
        node_id = None if held.link is None else held.link.node_id
        self.metrics.restore_ended(parts, outcome, pages, self.tenant, node_id)

    # ---- async forms -----------------------------------------------------------------------
    async def aput(self, keys: Keys, kv: Any, **options: Any) -> PutResult:
        return await asyncio.to_thread(self.put, keys, kv, **options)

    async def aexists(self, keys: Keys, **options: Any) -> int:
        return await asyncio.to_thread(self.exists, keys, **options)

    async def aget(self, keys: Keys, out: Any, **options: Any) -> int:
        return await asyncio.to_thread(self.get, keys, out, **options)

    async def arestore_report(self, keys: Keys, out: Any, **options: Any) -> RestoreReport:
        return await asyncio.to_thread(self.restore_report, keys, out, **options)

    # ---- stats and lifecycle ---------------------------------------------------------------
    def stats(self, *, nodes: bool = True) -> dict[str, Any]:
        """This client's counters and per-path tallies; with ``nodes``, each node's stats
        (one call per node: control plane, not for the serving loop), asked once this
        client's releases have run there."""
        counters, paths = self.tally.snapshot()
        with self._lock:
            out: dict[str, Any] = {
                "client": {
                    **counters,
                    "fanouts": self._locator.fanouts,
                    "release_calls": self._locator.release_calls,
                    "releases_unawaited": self._locator.releases_unawaited,
                    "finds_unawaited": self._locator.finds_unawaited,
                    **self.nodes.direct_stats(),
                },
                "paths": paths,
                "local_node_id": self.nodes.local_node_id,
                "staging_bytes": self._staging.nbytes,
            }
        out["metrics"] = self.metrics.snapshot()
        if nodes:
            self._locator.settle_unawaited()
            out["nodes"] = self.nodes.stats(self.config.rpc_timeout_s)
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pipelines = list(self._pipelines.values())
        for pipeline in pipelines:
            pipeline.close()
        self._locator.close()
        self.nodes.close()
        self._targets.close()
        self._staging.close()
        for agent in self._agents.values():
            agent.close()
        self._agents.clear()

    def __enter__(self) -> FlatCakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
