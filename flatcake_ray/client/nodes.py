"""The client's view of the storage nodes: who they are, which is local, how to reach each.

Nodes are found by name in the service's Ray namespace (``flatcake-node-<ray node id>``),
never through the coordinator, so reads keep working while it is down. "Local" means the
node runs on this process's Ray node (by Ray node id, not by path: on a one-machine test
cluster every node's files are visible to every process, and a client must still take the
remote path for another node's pages).

Each :class:`NodeLink` makes its transports on first use, one per (path, medium), each with a
lock (a transport serves one read at a time). A node that fails or times out is marked down
for ``node_down_s``; its pages are misses meanwhile, and the next refresh re-describes it.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Any

from flatcake_ray.actors.drain import read_drained
from flatcake_ray.actors.protocol import NO_LOCAL_NODE, NODE_NAME_PREFIX, NodeDescription
from flatcake_ray.client.calls import BoundNode
from flatcake_ray.client.direct import DirectCalls
from flatcake_ray.config import ServiceConfig
from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import (
    AccessDeniedError,
    PeerDisconnectedError,
    ServiceError,
    TransferTimeoutError,
)
from flatcake_ray.media.fd_handout import ChunkReceiver, HandedChunk
from flatcake_ray.transports import base
from flatcake_ray.transports.local_dram import LocalDramTransport
from flatcake_ray.transports.local_ssd import GdsSsdTransport, LocalSsdTransport
from flatcake_ray.transports.object_store import ObjectStoreTransport
from flatcake_ray.transports.registry import transport_class
from flatcake_ray.transports.remote_ssd import NvmeofSsdTransport, ShippedSsdTransport, visible_pool

log = logging.getLogger(__name__)
REFRESH_EVERY_S = 2.0


@functools.cache
def process_paths() -> frozenset[str]:
    """The remote paths this process can drive at all (probed once)."""
    found = set()
    for name in (base.REMOTE_DRAM_NIXL, base.REMOTE_DRAM_RDMA, base.REMOTE_SSD_NVMEOF):
        reason = transport_class(name).probe()
        if reason is None:
            found.add(name)
        else:
            log.info("%s unavailable here: %s", name, reason)
    return frozenset(found)


class NodeLink:
    def __init__(
        self,
        handle: Any,
        description: NodeDescription,
        local: bool,
        config: ServiceConfig,
        direct_calls: bool = False,
        remote_direct_calls: bool = False,
    ) -> None:
        self.handle = handle
        self.description = description
        self.node_id = description.node_id
        self.local = local
        self.config = config
        # Lookups and releases over a socket (client/direct.py): a Unix socket to the node on
        # this machine, TCP to a node on another.
        wanted = direct_calls if local else remote_direct_calls
        self.direct = (
            DirectCalls(handle, config.rpc_timeout_s, over_tcp=not local) if wanted else None
        )
        self.down_until = 0.0
        self._transports: dict[tuple[str, Medium], tuple[Any, threading.Lock]] = {}
        self._extra: list[Any] = []  # NIXL readers inside composite transports
        self._lock = threading.Lock()
        self._nvmeof_paths, self.nvmeof_reason = visible_pool(
            config.nvmeof_root,
            description.node_id,
            description.pool_paths,
            description.pool_file_bytes,
        )

    def is_up(self, now: float) -> bool:
        return now >= self.down_until

    def available(self, allowed: frozenset[str]) -> frozenset[str]:
        """The remote paths usable to this node: what this process can drive, what the node
        exports, and what the caller allows."""
        if self.local:
            return frozenset()
        paths = set(process_paths())
        if self.description.nixl_reason is not None or self.description.arena_nixl is None:
            paths.discard(base.REMOTE_DRAM_NIXL)
        if not self.description.rdma:
            paths.discard(base.REMOTE_DRAM_RDMA)
        if self._nvmeof_paths is None:
            paths.discard(base.REMOTE_SSD_NVMEOF)
        return frozenset(paths & allowed)

    def transport(self, path: str, medium: Medium, agent: Any) -> tuple[Any, threading.Lock]:
        key = (path, medium)
        with self._lock:
            known = self._transports.get(key)
            broken = False
            if known is not None and known[0].broken:
                # A NIXL transport is dead after any transfer error (its peer was removed):
                # reusing it would turn this node's pages into misses for good.
                with known[1]:
                    known[0].close()
                known, broken = None, True
            if known is None:
                known = (self._make(path, medium, agent, fresh=broken), threading.Lock())
                self._transports[key] = known
            return known

    def learn_arena_chunk(self, chunk: HandedChunk) -> None:
        """A chunk of the node's arena this process was handed for a put: restores from it
        (through the local-DRAM transport, where this process has one yet) need no call."""
        with self._lock:
            known = self._transports.get((base.LOCAL_DRAM, Medium.DRAM))
        if known is not None:
            transport: LocalDramTransport = known[0]
            transport.learn([HandedChunk(chunk.offset, chunk.nbytes, os.dup(chunk.fd))])

    def _make(self, path: str, medium: Medium, agent: Any, *, fresh: bool = False) -> Any:
        """``fresh``: the last one broke; the node's exports may have changed since it was
        described (a chunk given a fresh file is registered again: ``renew_arena_chunk``)."""
        d = self.description
        timeout = self.config.rpc_timeout_s
        pool_bytes = d.pool_file_bytes * len(d.pool_paths)
        if path == base.LOCAL_DRAM:
            return LocalDramTransport.attach(lambda: self.hand_chunks("arena"), d.arena_bytes)
        if path == base.LOCAL_SSD:
            return LocalSsdTransport.open(d.pool_paths, d.pool_file_bytes)
        if path == base.LOCAL_SSD_GDS:
            return GdsSsdTransport(d.pool_paths, d.pool_file_bytes)
        if path == base.REMOTE_SSD_NVMEOF:
            if self._nvmeof_paths is None:
                raise ServiceError(
                    f"node {self.node_id}'s pool is not visible: {self.nvmeof_reason}"
                )
            return NvmeofSsdTransport.open(self._nvmeof_paths, d.pool_file_bytes)
        if path == base.OBJECT_STORE_FALLBACK:
            size = d.arena_bytes if medium is Medium.DRAM else pool_bytes
            return ObjectStoreTransport(self.handle, medium, size, timeout)
        from flatcake_ray.transports.nixl_dram import NixlDramTransport

        if path == base.REMOTE_DRAM_NIXL:
            refresh = self._arena_nixl_now
            peer = (refresh() if fresh else None) or d.arena_nixl
            return NixlDramTransport(agent("arena"), peer, timeout_s=timeout, refresh=refresh)
        if path == base.REMOTE_SSD_SHIPPED:
            reader = NixlDramTransport(agent("ship"), d.ship_nixl, timeout_s=timeout)
            self._extra.append(reader)
            return ShippedSsdTransport(self.handle, reader, d.ship_nixl.length, pool_bytes, timeout)
        if path == base.REMOTE_DRAM_RDMA:
            return self._rdma(timeout)
        raise ServiceError(f"no transport named {path!r}")

    def _described_now(self) -> NodeDescription:
        """The node's description as it stands now: the arena chunks this tenant holds
        there now, and how to reach them (NIXL peer, RDMA keys)."""
        import ray

        return ray.get(self.handle.describe.remote(), timeout=self.config.rpc_timeout_s)

    def _arena_nixl_now(self) -> Any:
        return self._described_now().arena_nixl

    def hand_chunks(self, memory: str, offsets: list[int] | None = None) -> list[HandedChunk]:
        """This tenant's chunks of the node's ``memory`` ("arena" or "landing"; at
        ``offsets``, None: every one it holds now), as descriptors this process owns: the
        node is on this machine (``media/fd_handout.py``). A node that dies or does not
        answer meanwhile is a transfer error (a put's typed failure, a restore's miss)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        timeout = self.config.rpc_timeout_s
        with ChunkReceiver() as receiver:
            ref = self.handle.hand_chunks.remote(receiver.name, memory, offsets)
            try:
                count, sender = ray.get(ref, timeout=timeout)
            except RayActorError as exc:
                raise PeerDisconnectedError(
                    f"storage node {self.node_id} went away handing out its {memory}: {exc}"
                ) from exc
            except GetTimeoutError as exc:
                raise TransferTimeoutError(
                    f"storage node {self.node_id} did not hand out its {memory} in {timeout} s"
                ) from exc
            return receiver.receive(sender, count, timeout)

    def _rdma(self, timeout: float) -> Any:
        import ray

        from flatcake_ray.transports.rdma_verbs import RdmaVerbsTransport

        def accept(mine: Any) -> Any:
            return ray.get(self.handle.accept_rdma.remote(mine), timeout=timeout)

        def regions_now() -> Any:  # the chunks its tenant holds there now (it may grow)
            return self._described_now().arena_rdma

        return RdmaVerbsTransport.connected(accept, timeout_s=timeout, refresh=regions_now)

    def close(self) -> None:
        if self.direct is not None:
            self.direct.close()
        with self._lock:
            for transport, lock in self._transports.values():
                with lock:
                    transport.close()
            for reader in self._extra:
                reader.close()
            self._transports.clear()
            self._extra.clear()


class NodeTable:
    """Every storage node of the namespace, keyed by NodeID, refreshed by name listing."""

    def __init__(
        self,
        namespace: str,
        my_ray_node_id: str,
        secret: str | None,
        direct_calls: bool = False,
        remote_direct_calls: bool = False,
    ) -> None:
        self.namespace = namespace
        # Lookups over a socket (NodeLink): to the local node; to nodes on other machines.
        self.direct_calls = direct_calls
        self.remote_direct_calls = remote_direct_calls
        self.secret = secret  # the tenant's (None: the open default tenant)
        self.my_ray_node_id = my_ray_node_id
        self.config: ServiceConfig | None = None
        self.links: dict[int, NodeLink] = {}
        self._names: dict[str, int] = {}
        self.drained: frozenset[int] = frozenset()  # NodeIDs that take no new scopes
        self._refreshed = 0.0
        self._lock = threading.Lock()

    def refresh(self, *, force: bool = False, timeout_s: float = 10.0) -> None:
        import ray

        now = time.monotonic()
        if not force and now - self._refreshed < REFRESH_EVERY_S:
            return
        with self._lock:
            self._refreshed = now
            self.drained = read_drained(self.namespace)
            listed = {
                e["name"]
                for e in ray.util.list_named_actors(all_namespaces=True)
                if e["namespace"] == self.namespace and e["name"].startswith(NODE_NAME_PREFIX)
            }
            for name in set(self._names) - listed:
                self._drop(name)
            stale = {n for n, i in self._names.items() if not self.links[i].is_up(now)}
            wanted = (listed - set(self._names)) | stale
            self._describe_all(wanted, timeout_s)

    def _describe_all(self, names: set[str], timeout_s: float) -> None:
        import ray
        from ray.exceptions import RayError

        handles: dict[str, Any] = {}
        refs: dict[str, Any] = {}
        for name in names:
            try:
                actor = ray.get_actor(name, namespace=self.namespace)
                handles[name] = BoundNode(actor, self.secret)
            except ValueError:  # gone since the listing
                continue
            refs[name] = handles[name].describe.remote()
        if not refs:
            return
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        for name, ref in refs.items():
            if ref not in ready:
                continue
            try:
                description = ray.get(ref)
                if self.config is None:
                    self.config = ray.get(handles[name].service_config.remote(), timeout=timeout_s)
            except AccessDeniedError:
                raise AccessDeniedError(
                    f"storage node {name} refused this client: its tenant secret "
                    "(ClientConfig.tenant_secret, FLATCAKE_TENANT_SECRET) names no tenant, or "
                    "the service has no open default tenant"
                ) from None
            except RayError as exc:
                log.info("storage node %s did not describe itself: %s", name, exc)
                continue
            self._adopt(name, handles[name], description)

    def _adopt(self, name: str, handle: Any, description: NodeDescription) -> None:
        old = self.links.get(description.node_id)
        if old is not None and old.description == description:
            old.down_until = 0.0  # it answered: it is back
            return
        if name in self._names:
            self._drop(name)
        local = description.ray_node_id == self.my_ray_node_id
        assert self.config is not None  # fetched with the first description
        link = NodeLink(
            handle, description, local, self.config, self.direct_calls, self.remote_direct_calls
        )
        self.links[description.node_id] = link
        self._names[name] = description.node_id

    def _drop(self, name: str) -> None:
        node_id = self._names.pop(name)
        link = self.links.pop(node_id, None)
        if link is not None:
            link.close()

    def mark_down(self, link: NodeLink, reason: str) -> None:
        if link.config is not None:
            link.down_until = time.monotonic() + link.config.node_down_s
        log.warning("storage node %d marked down: %s", link.node_id, reason)

    def renew(self, link: NodeLink) -> None:
        """Describe ``link``'s node again now (it restarted): its new link replaces this one,
        whose transports are closed, so no read goes through the old process's mappings."""
        self.mark_down(link, "restarted")
        with self._lock:
            names = [name for name, node_id in self._names.items() if node_id == link.node_id]
            self._describe_all(set(names), self.config.rpc_timeout_s if self.config else 10.0)

    def stats(self, timeout_s: float) -> dict[int, Any]:
        """Each live node's stats, asked at once; a node that fails to answer is marked
        down, one that answers late is left out."""
        import ray
        from ray.exceptions import RayError

        links = self.up()
        refs = [link.handle.stats.remote() for link in links]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        found: dict[int, Any] = {}
        for link, ref in zip(links, refs, strict=True):
            if ref not in ready:
                continue
            try:
                found[link.node_id] = ray.get(ref)
            except RayError as exc:
                self.mark_down(link, f"stats failed: {exc}")
        return found

    def direct_stats(self) -> dict[str, int]:
        """Calls answered over call channels, and channels that failed (those calls went
        over Ray)."""
        channels = [link.direct for link in list(self.links.values()) if link.direct is not None]
        return {
            "direct_calls": sum(channel.calls for channel in channels),
            "direct_failures": sum(channel.failures for channel in channels),
        }

    def up(self) -> list[NodeLink]:
        now = time.monotonic()
        return [link for link in list(self.links.values()) if link.is_up(now)]

    def get(self, node_id: int) -> NodeLink | None:
        return self.links.get(node_id)

    def require(self, node_id: int) -> NodeLink:
        """The link of a node that must be known (a typed error otherwise)."""
        link = self.links.get(node_id)
        if link is None:
            raise ServiceError(f"no storage node with NodeID {node_id} is known here")
        return link

    @property
    def local_node_id(self) -> int:
        for link in list(self.links.values()):
            if link.local:
                return link.node_id
        return NO_LOCAL_NODE

    def close(self) -> None:
        with self._lock:
            for name in list(self._names):
                self._drop(name)
