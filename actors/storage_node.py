"""StorageNode: one per Ray node, owning that node's FlatCakeStore. Control RPCs only.

A node registers with the coordinator (which gives it its NodeID, kept in ``<root>/node_id``
so a restart keeps it), exports its DRAM arena and its ship buffer over NIXL, and reports its
usage every ``report_interval_s``. It answers:

- ``lookup`` (with lease) / ``exists`` / ``release``: index lookups, one call per request per
  node, whatever the page count. A lease pins the scopes of the hits until released or until
  ``lease_ttl_s`` (its reader died); a reader whose lease ran out drops what it read.
- ``begin_put`` / ``write_pages`` / ``commit_put`` / ``abort_put``: a layer-wise put (the
  store's one put path, ``PutHandle``), a piece at a time; ``put_staged`` is the same put in
  one call when all its layers fit one staging region. The bytes of a piece are in a client's
  shared-memory staging buffer (same node), in a client's NIXL-registered staging buffer
  (pulled with one NIXL READ), or, as the labelled object-store fallback, inline in the call.
  Puts left open past ``lease_ttl_s`` are aborted.
- ``ship``/``unship``: SSD ranges into the NIXL ship buffer for readers on other nodes.
- ``read_ranges``: the object-store fallback for reads (labelled, last resort).

Reads of DRAM, by local clients (memcpy from the mapped arena) and remote ones (NIXL READs of
the exported arena), and of local SSD (clients open the pool files) never call the node
beyond the lookup and the release. A plain class: ``flatcake_ray/service.py`` wraps it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flatcake_ray import failpoints
from flatcake_ray.actors.leases import LeaseTable
from flatcake_ray.actors.protocol import (
    COORDINATOR_NAME,
    LeaseReply,
    NodeDescription,
    NodeUsage,
    PutTicket,
    StagedPages,
    node_actor_name,
)
from flatcake_ray.actors.shipping import PullArea, ShipBuffer, ShipReply
from flatcake_ray.actors.staged import StagedReader
from flatcake_ray.config import ServiceConfig
from flatcake_ray.core.api import Probe, PutResult
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.parts import lease_parts
from flatcake_ray.errors import ServiceError
from flatcake_ray.failpoints import failpoint
from flatcake_ray.node.store import FlatCakeStore
from flatcake_ray.transports.local_dram import LocalDramTransport

log = logging.getLogger(__name__)


class StorageNode:
    def __init__(self, config: ServiceConfig) -> None:
        import ray

        self.config = config
        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.actor_name = node_actor_name(self.ray_node_id)
        self.started_at = time.time()
        # The store's own root (FLATCAKE_ROOT may move it) also keeps this node's NodeID.
        wanted = config.store_config(self.ray_node_id, 1)
        self._root = Path(wanted.root)
        self._root.mkdir(parents=True, exist_ok=True)
        self.node_id = self._register(self._persisted_node_id())
        (self._root / "node_id").write_text(f"{self.node_id}\n")
        self.store = FlatCakeStore(dataclasses.replace(wanted, node_id=self.node_id))
        self.store.metrics.count_requests = False  # its clients count the requests they make
        self.leases = LeaseTable(config.lease_ttl_s)
        self.ship_buffer = ShipBuffer(config.ship_bytes, self.store.pool, ttl_s=config.lease_ttl_s)
        self._arena_exporter: Any = None
        self._export_agent: Any = None
        self._pull: PullArea | None = None
        self._arena_peer, self._ship_peer, self.nixl_reason = self._export()
        self._rdma = self._export_rdma()
        self._staged = StagedReader(self._pull, self.nixl_reason)
        self.counters = dict.fromkeys(
            ("lookups", "exists_calls", "releases", "puts", "puts_shm", "puts_nixl"), 0
        )
        self.counters.update(
            dict.fromkeys(("puts_inline", "fallback_reads", "lease_misses", "leased_pages"), 0)
        )
        self.counters.update(dict.fromkeys(("puts_layerwise", "put_pieces", "puts_aborted"), 0))
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, daemon=True)
        self._reporter.start()

    # ---- registration and reports ----------------------------------------------------------
    def _persisted_node_id(self) -> int | None:
        path = self._root / "node_id"
        if not path.exists():
            return None
        text = path.read_text().strip()
        if not text.isdigit():
            raise ServiceError(f"{path} holds {text!r}, not a NodeID")
        return int(text)

    def _coordinator(self) -> Any:
        import ray

        return ray.get_actor(COORDINATOR_NAME, namespace=self.config.namespace)

    def _register(self, wanted: int | None) -> int:
        import ray

        ref = self._coordinator().register.remote(
            self.ray_node_id, self.actor_name, wanted, self.started_at
        )
        return int(ray.get(ref, timeout=self.config.rpc_timeout_s))

    def _report_loop(self) -> None:
        from ray.exceptions import RayError

        while not self._stop.wait(self.config.report_interval_s):
            self.store.puts.expire(time.monotonic())
            try:
                self.report_now()
            except (RayError, ValueError, ServiceError) as exc:
                # The coordinator is down or restarting; the next report tries again.
                log.info("capacity report to the coordinator failed: %s", exc)

    def report_now(self) -> bool:
        import ray

        usage = NodeUsage.from_stats(self.node_id, self.store.stats())
        ref = self._coordinator().report.remote(self.node_id, self.ray_node_id, usage)
        known = ray.get(ref, timeout=self.config.rpc_timeout_s)
        if not known:  # a coordinator that lost us (restarted and we missed its rebuild)
            granted = self._register(self.node_id)
            if granted != self.node_id:
                raise ServiceError(
                    f"NodeID {self.node_id} was given to another node while the coordinator "
                    f"did not know this one (offered {granted}); restart this storage node"
                )
        return bool(known)

    # ---- NIXL exports ----------------------------------------------------------------------
    def _export(self) -> tuple[Any, Any, str | None]:
        from flatcake_ray.actors.nixl_roles import exporter_agent
        from flatcake_ray.transports.nixl_dram import (
            NixlArenaExporter,
            NixlDramTransport,
            unique_agent_name,
        )

        reason = NixlDramTransport.probe()
        if reason is not None:
            return None, None, reason
        tag = f"fc{self.node_id}"
        # One agent (one progress thread) serves both exported buffers.
        self._export_agent = exporter_agent(unique_agent_name(f"{tag}-export"))
        arena_peer = None
        if self.store.arena.nbytes:  # a node may run SSD-only
            view = self.store.arena.view
            self._arena_exporter = NixlArenaExporter(tag, view, agent=self._export_agent)
            arena_peer = self._arena_exporter.peer_info()
        ship_peer = self.ship_buffer.export(self._export_agent)
        self._pull = PullArea(unique_agent_name(f"{tag}-pull"))
        return arena_peer, ship_peer, None

    def _export_rdma(self) -> Any:
        from flatcake_ray.transports.rdma_verbs import RdmaArenaExporter, rdma_probe

        if rdma_probe() is not None or not self.store.arena.nbytes:
            return None
        return RdmaArenaExporter(self.store.arena.view)

    def accept_rdma(self, reader: Any) -> Any:
        """Connect a reader's RDMA queue pair to the exported arena (once per reader)."""
        if self._rdma is None:
            raise ServiceError("this node exports no RDMA memory region")
        return self._rdma.accept(reader)

    # ---- views -----------------------------------------------------------------------------
    def describe(self) -> NodeDescription:
        store = self.store
        return NodeDescription(
            ray_node_id=self.ray_node_id,
            node_id=self.node_id,
            actor_name=self.actor_name,
            layers=store.config.layers,
            page_bytes=store.config.page_bytes,
            arena_path=store.arena.path,
            arena_bytes=store.arena.nbytes,
            pool_paths=tuple(store.pool.paths),
            pool_file_bytes=store.pool.file_bytes,
            pool_direct=store.pool.direct,
            started_at=self.started_at,
            arena_nixl=self._arena_peer,
            ship_nixl=self._ship_peer,
            nixl_reason=self.nixl_reason,
            rdma=self._rdma is not None,
            verify_dram=store.config.verify_dram,
            gap_bytes=store.config.gap_bytes,
        )

    def coordinator_view(self) -> dict[str, Any]:
        """What a restarted coordinator rebuilds its state from."""
        return {
            "node_id": self.node_id,
            "ray_node_id": self.ray_node_id,
            "started_at": self.started_at,
            "usage": NodeUsage.from_stats(self.node_id, self.store.stats()),
            "sessions": list(self.store.catalog.sessions),
        }

    def stats(self) -> dict[str, Any]:
        return {
            **self.store.stats(),
            **self.counters,
            **self.ship_buffer.counters,
            "node_id": self.node_id,
            "ray_node_id": self.ray_node_id,
            "leases_held": len(self.leases),
            "leases_expired": self.leases.expired,
            "ship_regions_held": self.ship_buffer.regions.held,
            "nixl": self.nixl_reason or "ok",
        }

    def ping(self) -> int:
        return self.node_id

    def arm_failpoints(self, spec: str) -> int:
        """Arm failpoints in this node's process (tests and chaos runs only: refused unless
        the node was started with ``FLATCAKE_FAILPOINTS_REMOTE=1``); an empty spec disarms."""
        if os.environ.get("FLATCAKE_FAILPOINTS_REMOTE") != "1":
            raise ServiceError("remote failpoints are off on this node")
        failpoints.disarm_all()
        return len(failpoints.arm_from_spec(spec))

    def service_config(self) -> ServiceConfig:
        return self.config

    # ---- lookups ---------------------------------------------------------------------------
    def lookup(self, keys: Sequence[Any], namespace: str | None = None) -> LeaseReply:
        """The consecutive hits from the first key, leased (zero hits: nothing is held)."""
        self._expire_leases()
        self.counters["lookups"] += 1
        lease = self.store.lease(keys, namespace=namespace)
        if lease.hits == 0:
            self.store.release(lease)
            return LeaseReply(self.node_id, 0, 0)
        self.leases.add(lease)
        self.counters["leased_pages"] += lease.hits
        return LeaseReply(self.node_id, lease.lease_id, lease.hits, lease_parts(lease))

    def exists(self, keys: Sequence[Any], namespace: str | None = None) -> int:
        self.counters["exists_calls"] += 1
        return self.store.exists(keys, namespace=namespace)

    def probe(self, keys: Sequence[Any], namespace: str | None = None) -> Probe:
        self.counters["exists_calls"] += 1
        return self.store.probe(keys, namespace=namespace)

    def gvas(self, keys: Sequence[Any], namespace: str | None = None) -> np.ndarray:
        return self.store.gvas(keys, namespace=namespace)

    def release(self, lease_id: int, bad_scopes: Sequence[int] = ()) -> bool:
        """True when the lease was still held: what its reader read is good."""
        failpoint("node.release", lease_id=lease_id)
        self.counters["releases"] += 1
        lease = self.leases.pop(lease_id)
        if lease is None:
            self.counters["lease_misses"] += 1
            return False
        if bad_scopes:
            # A reader saw a bad checksum: read those scopes here, so the store's own check
            # quarantines them if the medium really is bad (a torn remote read does not).
            self.store.recheck(lease, set(bad_scopes))
        else:
            self.store.release(lease)
        return True

    def _expire_leases(self) -> None:
        for lease in self.leases.expire(time.monotonic()):
            self.store.release(lease)

    # ---- puts ------------------------------------------------------------------------------
    def begin_put(
        self,
        keys: Sequence[Any],
        namespace: str | None = None,
        session_id: str | None = None,
        parent: Any = None,
        hints: PutHints | None = None,
    ) -> PutTicket:
        """Plan a layer-wise put and hold it open for ``write_pages`` pieces."""
        options = {"namespace": namespace, "session_id": session_id, "parent": parent}
        handle = self.store.begin_put(keys, hints=hints, **options)
        self.counters["puts_layerwise"] += 1
        return PutTicket(handle.put_id, handle.pages_new)

    def write_pages(self, put_id: int, staged: StagedPages) -> None:
        """Write the staged pieces of an open put; a failure aborts the whole put."""
        handle = self.store.puts.get(put_id)
        try:
            self._staged.write(handle, staged, self.counters)
        except BaseException:
            handle.abort()
            self.counters["puts_aborted"] += 1
            raise

    def commit_put(self, put_id: int) -> PutResult:
        result = self.store.puts.get(put_id).commit()
        self.counters["puts"] += 1
        return result

    def abort_put(self, put_id: int) -> None:
        self.store.puts.get(put_id).abort()
        self.counters["puts_aborted"] += 1

    def put_staged(
        self,
        keys: Sequence[Any],
        staged: StagedPages,
        namespace: str | None = None,
        session_id: str | None = None,
        parent: Any = None,
        hints: PutHints | None = None,
    ) -> PutResult:
        """A whole put whose every layer is staged at once: plan, write, commit, one call."""
        options = {"namespace": namespace, "session_id": session_id, "parent": parent}
        with self.store.begin_put(keys, hints=hints, **options) as handle:
            self._staged.write(handle, staged, self.counters)
            result = handle.commit()
        self.counters["puts"] += 1
        return result

    # ---- shipped SSD reads and the object-store fallback -----------------------------------
    def ship(self, src_offsets: np.ndarray, lengths: np.ndarray) -> ShipReply:
        return self.ship_buffer.ship(src_offsets, lengths)

    def unship(self, region_id: int) -> bool:
        return self.ship_buffer.unship(region_id)

    def read_ranges(self, medium: int, src_offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """LAST RESORT (object-store fallback): the ranges' bytes, packed, as the reply."""
        self.counters["fallback_reads"] += 1
        if Medium(medium) is Medium.SSD:
            return self.ship_buffer.read_ssd(src_offsets, lengths)
        from flatcake_ray.transports.base import ReadBatch

        batch = ReadBatch.packed(src_offsets, lengths)
        out = np.empty(batch.total_bytes, dtype=np.uint8)
        LocalDramTransport(self.store.arena.view).read(batch, out)
        return out

    # ---- lifecycle -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop reporting, drop the NIXL exports and close the store (SSD scopes survive)."""
        self._stop.set()
        if self._rdma is not None:
            self._rdma.close()
            self._rdma = None
        if self._arena_exporter is not None:
            self._arena_exporter.close()
            self._arena_exporter = None
        self._staged.close()
        self.ship_buffer.close()
        if self._export_agent is not None:
            self._export_agent.close()
            self._export_agent = None
        self.store.close()
