"""StorageNode: one per Ray node, owning that node's FlatCakeStore. Control RPCs only.

Every call names who makes it, first argument: a tenant's secret (``None`` for the open
default tenant), or the service secret for the service's own calls (``coordinator_view``,
``stats`` of every tenant, ``arm_failpoints``, ``shutdown``). A call with a secret the node
does not know is refused (:class:`AccessDeniedError`, counted), and whatever it names (keys,
leases, puts, ship regions) is looked for in the caller's tenant only. The tenant table comes
from the GCS, signed (``actors/auth.py``); the node re-reads it on every report and when it
meets a secret it does not know.

The node registers with the coordinator (``actors/membership.py``), exports its DRAM arena
and its ship buffer over NIXL (``actors/node_exports.py``), and answers:

- ``lookup`` (with lease) / ``exists`` / ``probe`` / ``release``: index lookups, one call per
  request per node, whatever the page count (``actors/node_lookups.py``). ``find``,
  ``record_home``, ``home_of``: the node as a chain's home (``actors/homes.py``). A lease
  pins the scopes of the hits until released or until ``lease_ttl_s``. ``release`` answers
  whether the lease was held and every scope it pinned is intact: only then is what its
  reader copied good.
- ``begin_put`` / ``land`` / ``commit_put`` / ``abort_put``: a layer-wise put (the store's one
  put path, ``PutHandle``) whose bytes the client writes into memory this node hands out: the
  arena in place for DRAM, landing slots for SSD (``actors/node_puts.py``).
- ``hand_chunks``: the caller's tenant's memory, as descriptors, to a client on this machine.
- ``ship``/``unship`` and ``read_ranges`` (the labelled object-store fallback): bytes of
  ranges the caller's tenant holds a lease on, at most ``ship_bytes`` per call;
  ``ship_stream``/``ship_stop``: a whole restore's shipped windows in one streaming call.

A plain class: ``flatcake_ray/client/deploy.py`` wraps it with ``ray.remote``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

from flatcake_ray import failpoints
from flatcake_ray.actors.auth import service_gate
from flatcake_ray.actors.call_channels import CHANNELS_PER_TENANT, CallChannels
from flatcake_ray.actors.homes import HomeCalls, HomeDirectory
from flatcake_ray.actors.landing import LandingArea
from flatcake_ray.actors.leased_bytes import LeasedBytes, LeasedBytesCalls
from flatcake_ray.actors.leases import LeaseTable
from flatcake_ray.actors.membership import Membership
from flatcake_ray.actors.memory_handout import (
    MemoryHandout,
    keep_memory_private,
    memory_is_private,
)
from flatcake_ray.actors.node_exports import NodeExports
from flatcake_ray.actors.node_lookups import LookupCalls
from flatcake_ray.actors.node_puts import NodePuts
from flatcake_ray.actors.node_tenants import NodeTenants
from flatcake_ray.actors.protocol import (
    NodeDescription,
    NodeUsage,
    PutTicket,
    node_actor_name,
)
from flatcake_ray.actors.shipping import ShipBuffer
from flatcake_ray.actors.supervision import DramHeld, Supervision
from flatcake_ray.actors.tenant_limits import TenantLimits
from flatcake_ray.actors.wire import check_request
from flatcake_ray.config import ServiceConfig
from flatcake_ray.core.api import PutResult
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.tenants import Tenant
from flatcake_ray.errors import MediumFullError, ServiceError
from flatcake_ray.node.root_slot import RootSlot
from flatcake_ray.node.store import FlatCakeStore

_COUNTERS = (
    *("lookups", "exists_calls", "releases", "puts", "puts_arena", "puts_landing"),
    *("puts_inline", "puts_none", "puts_layerwise", "puts_aborted", "aborts_refused"),
    "tenants_removed",
    *("fallback_reads", "lease_misses", "leased_pages", "leases_broken", "ranges_refused"),
    "chunk_handouts",  # hand_chunks answered: a client on this machine mapped memory anew
)

log = logging.getLogger(__name__)


class StorageNode(LookupCalls, HomeCalls, LeasedBytesCalls):
    def __init__(self, config: ServiceConfig, service_secret: str) -> None:
        import ray

        if config.private_node_memory:
            keep_memory_private()  # before any chunk exists
        self.config = config
        self.ray_node_id = ray_node_id = ray.get_runtime_context().get_node_id()
        self.started_at = time.time()
        self.gate = service_gate(config, service_secret)
        self.gate.refresh()
        name = node_actor_name(self.ray_node_id)
        self.membership = Membership(
            config, service_secret, self.ray_node_id, name, self.started_at
        )
        # The store's root (FLATCAKE_ROOT may move it) keeps the NodeID too; {slot}: root_slot.py
        self.slot = RootSlot.claim(lambda slot: config.store_config(ray_node_id, 1, slot=slot).root)
        wanted = config.store_config(ray_node_id, 1, slot=self.slot.index)
        root = self.slot.root
        self.node_id = self.membership.join(root)
        self.store = FlatCakeStore(dataclasses.replace(wanted, node_id=self.node_id))
        self.store.metrics.count_requests = False  # its clients count the requests they make
        reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
        self.supervision = Supervision(root, reconstructed)
        self.store.metrics.restarted(self.supervision.restarts, self.supervision.lost.scopes)
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.limits = TenantLimits(config)
        self.tenants = NodeTenants(self.gate, self.store, self.limits, self.counters)
        self.leases = LeaseTable(config.lease_ttl_s)
        self.homes = HomeDirectory(root / "homes.log")  # chains this node is home to
        self.tenants.on_removed += [self.leases.drop_tenant, self.homes.drop_tenant]
        self.ship_buffer = ShipBuffer(config.ship_bytes, self.store.pool, ttl_s=config.lease_ttl_s)
        landing_name = f"{config.namespace}-landing-{self.node_id}"
        landing = self.landing = LandingArea(
            config.landing_bytes,
            landing_name,
            config.dram_chunks,
            hugepages=config.hugepages != "off",
        )
        self.tenants.on_removed.append(landing.forget)
        self.puts = NodePuts(self.store, landing, self.counters, (os.getpid(), self.started_at))
        self.handout = MemoryHandout(self.store, landing, config.rpc_timeout_s)
        self.exports = NodeExports(
            self.node_id, self.store.arena, self.ship_buffer, landing, self._peers_hold
        )
        self.puts.arena_peer = self.exports.arena_peer
        self.store.arena.on_renewed.append(self.exports.renew_arena_chunk)
        self.leased_bytes = LeasedBytes(
            config,
            self.ship_buffer,
            lambda tenant, medium: self.leases.ranges(tenant, medium, self.store.lease_runs),
            lambda: self.store.arena.view,
            self.counters,
        )
        self.channels = CallChannels(self._direct, CHANNELS_PER_TENANT, config.rpc_timeout_s)
        self._stop = threading.Event()
        reports = (self._stop, self._tick, self._usage)
        self._reporter = threading.Thread(target=self.membership.run, args=reports, daemon=True)
        self._reporter.start()

    def _tenant(self, secret: object, *, metered: bool = True) -> Tenant:
        return self.tenants.caller(secret, metered=metered)

    # ---- reports ---------------------------------------------------------------------------
    def _tick(self) -> None:
        """Before each report: expire puts and leases, re-read the tenant table, give the
        chunks tenants left empty fresh files (off the store's lock)."""
        self.store.puts.expire(time.monotonic())
        self._expire_leases()
        self.gate.refresh()
        self.tenants.sync()
        for memory in (self.store, self.landing):
            try:
                memory.hand_over_vacated()
            except MediumFullError as exc:  # no memory for a fresh file now: its taker pays
                log.warning("a vacated chunk keeps its file for now: %s", exc)

    def report_now(self) -> bool:
        return bool(self.membership.report(self._usage()))

    def _usage(self) -> NodeUsage:
        held = DramHeld.of(self.store)
        self.supervision.note(held)
        return NodeUsage.from_stats(self.node_id, self.store.stats(), held.scopes, held.pages)

    def _peers_hold(self) -> bool:
        """Leases, ship regions or puts are out: peers may READ or WRITE memory now."""
        return bool(len(self.leases) or self.ship_buffer.regions.held or len(self.store.puts))

    # ---- views -----------------------------------------------------------------------------
    def describe(self, secret: object) -> NodeDescription:
        """How the caller's tenant reaches this node's media (its own geometry)."""
        tenant = self._tenant(secret)
        store, exports = self.store, self.exports
        return NodeDescription(
            ray_node_id=self.ray_node_id,
            node_id=self.node_id,
            actor_name=self.membership.actor_name,
            layers=tenant.layers,
            page_bytes=tenant.page_bytes,
            arena_chunks=store.arena_chunks(tenant.name),
            arena_bytes=store.arena.nbytes,
            pool_paths=tuple(store.pool.paths),
            pool_file_bytes=store.pool.file_bytes,
            pool_direct=store.pool.direct,
            started_at=self.started_at,
            arena_nixl=exports.arena_peer(store.arena_chunks(tenant.name)),
            arena_rdma=exports.rdma_regions(store.arena_chunks(tenant.name)),
            ship_nixl=exports.ship_peer,
            nixl_reason=exports.nixl_reason,
            rdma=exports.rdma,
            verify_dram=store.config.verify_dram,
            gap_bytes=store.config.gap_bytes,
            tenant=tenant.name,
            owner=self.puts.owner,
        )

    def service_config(self, secret: object) -> ServiceConfig:
        self._tenant(secret)
        return self.config

    def coordinator_view(self, service_secret: object) -> dict[str, Any]:
        """What a restarted coordinator rebuilds its state from."""
        self.gate.service(service_secret)
        sessions = [
            (catalog.tenant, session_id)
            for catalog in self.store.tenancy
            for session_id in catalog.sessions
        ]
        return {
            "node_id": self.node_id,
            "ray_node_id": self.ray_node_id,
            "started_at": self.started_at,
            "usage": NodeUsage.from_stats(self.node_id, self.store.stats()),
            "sessions": sessions,
        }

    def stats(self, secret: object) -> dict[str, Any]:
        """The node's counters; a tenant sees its own tenant's use only, the service all."""
        mine = None if self.gate.is_service(secret) else self._tenant(secret).name
        stats = {
            **self.store.stats(),
            **self.counters,
            **self.ship_buffer.counters,
            **self.leases.counters,
            **self.gate.counters,
            **self.limits.counters,
            **self.supervision.stats(),
            "node_id": self.node_id,
            "ray_node_id": self.ray_node_id,
            "root": str(self.slot.root),
            "leases_held": len(self.leases),
            "direct_calls": self.channels.served,
            "call_channels": self.channels.count(),
            "ship_regions_held": self.ship_buffer.regions.held,
            "nixl": self.exports.nixl_reason or "ok",
            "memory_private": memory_is_private(),  # non-dumpable (private_node_memory)
        }
        if mine is not None:
            stats["tenants"] = {mine: stats["tenants"].get(mine, {})}
        return stats

    def ping(self) -> int:
        return self.node_id

    def refresh_tenants(self, service_secret: object) -> int:
        """Re-read the tenant table now (the coordinator, after a tenant command); returns
        how many tenants it names."""
        self.gate.service(service_secret)
        self.gate.refresh()
        self.tenants.sync()
        return len(self.tenants.table)

    def arm_failpoints(self, service_secret: object, spec: str) -> int:
        """Arm failpoints in this node's process (tests and chaos runs only: refused unless
        the node was started with ``FLATCAKE_FAILPOINTS_REMOTE=1``); an empty spec disarms."""
        self.gate.service(service_secret)
        if os.environ.get("FLATCAKE_FAILPOINTS_REMOTE") != "1":
            raise ServiceError("remote failpoints are off on this node")
        failpoints.disarm_all()
        return len(failpoints.arm_from_spec(spec))

    def hand_chunks(
        self, secret: object, socket_name: object, memory: object, offsets: Any = None
    ) -> tuple[int, int]:
        """The caller's tenant's chunks of ``memory`` sent to its process listening on
        ``socket_name`` (``actors/memory_handout.py``): how many, and this process's id."""
        sent = self.handout.hand(self._tenant(secret).name, socket_name, memory, offsets)
        self.counters["chunk_handouts"] += 1
        return sent, os.getpid()

    def open_calls(self, secret: object, socket_name: object) -> int:
        """Connect to the caller's process on this machine, listening on ``socket_name``,
        and serve its lookups and releases there (``actors/call_channels.py``); returns this
        process's id, which the caller checks the connection came from."""
        self.channels.open(self._tenant(secret).name, secret, socket_name)
        return os.getpid()

    def open_remote_calls(self, secret: object, host: object, port: object, token: object) -> None:
        """Connect to the caller's process on another machine, listening on ``host:port``
        (an address of this Ray cluster), present ``token``, and serve its lookups and
        releases there (``actors/call_channels.py``)."""
        self.channels.open_remote(self._tenant(secret).name, secret, host, port, token)

    def _direct(self, secret: object, method: str, args: tuple[Any, ...]) -> Any:
        return getattr(self, method)(secret, *args)

    def accept_rdma(self, secret: object, reader: Any) -> Any:
        """Connect a reader's RDMA queue pair to the exported arena (once per reader)."""
        chunks = self.store.arena_chunks(self._tenant(secret).name)
        return self.exports.accept_rdma(reader, chunks)

    # ---- puts (actors/node_puts.py) ------------------------------------------------------
    def begin_put(
        self,
        secret: object,
        keys: Any,
        namespace: Any = None,
        session_id: Any = None,
        parent: Any = None,
        hints: PutHints | None = None,
    ) -> PutTicket:
        """Plan a layer-wise put; the ticket says where its bytes go."""
        tenant = self._tenant(secret).name
        check_request(keys, namespace, hints)
        self.limits.put(tenant, self.store.puts.open_of(tenant))
        options = {"namespace": namespace, "session_id": session_id, "parent": parent}
        ticket = self.puts.begin(tenant, keys, {**options, "hints": hints})
        self.exports.wake()
        return ticket

    def land(
        self, secret: object, put_id: object, layer: object, inline: Any = None, sums: Any = None
    ) -> None:
        """Layer ``layer`` of an SSD put is in its slot (``sums``: its writer's) or ``inline``."""
        self.puts.land(self._tenant(secret).name, put_id, layer, inline, sums)

    def commit_put(
        self, secret: object, put_id: object, in_place: Any = (), sums: Any = ()
    ) -> PutResult:
        return self.puts.commit(self._tenant(secret).name, put_id, in_place, sums)

    def abort_put(self, secret: object, put_id: object) -> None:
        self.puts.abort(self._tenant(secret, metered=False).name, put_id)

    # ---- lifecycle -------------------------------------------------------------------------
    def shutdown(self, service_secret: object) -> None:
        """Stop reporting, drop the NIXL exports and close the store (SSD scopes survive)."""
        self.gate.service(service_secret)
        self._stop.set()
        self.channels.close()
        self.exports.close()
        self.puts.close()
        self.ship_buffer.close()
        self.exports.close_agent()
        self.store.close()
        self.homes.close()
        self.slot.close()
