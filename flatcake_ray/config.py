"""Configuration: frozen dataclasses, every field type- and range-checked (:class:`ConfigError`)
whatever the source (``config_sources.py`` has the rules). Every field of :class:`StoreConfig`
(and of its :class:`PlacementConfig`) and of :class:`ServiceConfig` can be overridden by an
environment variable named
``FLATCAKE_<FIELD>`` (upper case), e.g. ``FLATCAKE_DRAM_BYTES=4GiB``,
``FLATCAKE_SSD_DIRS=/mnt/nvme0/fc:/mnt/nvme1/fc``, ``FLATCAKE_TAU_TOKENS=2048``.
Sizes (fields named ``*_bytes``) accept ``K/M/G/T`` (powers of 1024, ``KiB`` and ``KB``
alike); booleans accept ``1/0/true/false/yes/no/on/off``; lists of folders are
``:``-separated. In a service's ``root`` and ``ssd_dirs``, after every override: ``{host}``
is the host name, ``{slot}`` the smallest slot of that root no other storage node of the
machine holds (``node/root_slot.py``), ``{namespace}`` the namespace, ``{node}`` the Ray node
id (new for every Ray node: keep it out of roots meant to survive a restart).

:class:`StoreConfig` and :class:`PlacementConfig` live in ``config_store.py`` (what the lower
floors read) and are re-exported here with the shared :data:`ALIGN`.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from flatcake_ray.config_sources import (
    ENV_PREFIX,
    Source,
    build_config,
    normalise,
    parse_size,
)
from flatcake_ray.config_store import ALIGN, PlacementConfig, StoreConfig, require
from flatcake_ray.errors import GeometryMismatchError

__all__ = [
    "ALIGN",
    "ENV_PREFIX",
    "ClientConfig",
    "PlacementConfig",
    "ServiceConfig",
    "Source",
    "StoreConfig",
    "build_config",
    "parse_size",
]

DEFAULT_SECRET_FILE = "~/.flatcake/{namespace}.secret"
GEOMETRY_FIELDS = ("layers", "page_bytes")
# The service fields a node's store takes.
STORE_FIELDS: tuple[str, ...] = (*GEOMETRY_FIELDS, "root", "dram_bytes", "ssd_dirs")
STORE_FIELDS += ("ssd_files_per_dir", "ssd_file_bytes", "hugepages", "fsync", "verify_dram")
STORE_FIELDS += ("dram_chunks", "ssd_prewrite", "ssd_prewrite_paced")


def path_component(text: str) -> str:
    """``text`` as one safe path component (no separators, never ``.`` or ``..``)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text)
    return cleaned if cleaned.strip(".") else "_" + cleaned


def host_name() -> str:
    """This machine's host name as one path component (``{host}`` in a root)."""
    return path_component(socket.gethostname())


def secret_path(namespace: str, secret_file: str = "") -> str:
    """Where the service secret of ``namespace`` is kept (see ``ServiceConfig.secret_file``)."""
    chosen = secret_file or os.environ.get("FLATCAKE_SECRET_FILE") or DEFAULT_SECRET_FILE
    return chosen.replace("{namespace}", namespace)


@dataclass(frozen=True)
class ServiceConfig:
    """The service's knobs: the store geometry every node shares, per-node sizes (each node's
    ``FLATCAKE_*`` variables override them again for its own store), and service timings."""

    namespace: str = "flatcake"  # the Ray namespace of the coordinator and storage nodes
    # Stable for a machine: a node restarted there finds its NodeID and SSD scopes again;
    # {slot} keeps several storage nodes of one machine (and namespace) apart.
    root: str = "/var/tmp/flatcake/{namespace}/{host}-{slot}"
    layers: int = 32
    page_bytes: int = 64 << 10
    dram_bytes: int = 1 << 30
    # Each node's arena in chunks owned by one tenant at a time (StoreConfig.dram_chunks): a
    # client is handed its own tenant's chunks only (docs/security.md).
    dram_chunks: int = 8
    ssd_dirs: tuple[str, ...] = ()
    ssd_files_per_dir: int = 4
    ssd_file_bytes: int = 1 << 30
    ssd_prewrite: bool = False  # StoreConfig.ssd_prewrite; examples/cluster.yaml turns it on
    ssd_prewrite_paced: bool = True  # StoreConfig.ssd_prewrite_paced
    hugepages: str = "auto"
    fsync: bool = True
    # Readers check DRAM too: clients write puts into a node's shared memory, and the check
    # keeps another writer's bytes from being delivered (off: trust every writer).
    verify_dram: bool = True
    ship_bytes: int = 64 << 20  # each node's NIXL bounce buffer for shipped SSD reads
    # Node memory clients write a put's SSD layers into (two layers per put in flight), which
    # the node writes to its drive: a put that finds it full sends its bytes in the call.
    landing_bytes: int = 64 << 20
    lease_ttl_s: float = 60.0  # a lease not released by then is dropped (its reader is gone)
    rpc_timeout_s: float = 10.0  # a client waits this long for a node before calling it down
    node_down_s: float = 5.0  # ... and skips that node this long before trying it again
    # storage node -> coordinator capacity reports while usage changes; an idle node's every
    # third of node_timeout_s (actors/membership.py)
    report_interval_s: float = 2.0
    node_timeout_s: float = 10.0  # no report for this long: the coordinator stops placing there
    ramp_seconds: float = 60.0  # a newly joined node reaches its full share of new scopes
    ramp_floor: float = 0.1  # ... starting from this fraction of it
    nvmeof_root: str = ""  # where remote pools appear on this node, e.g. /mnt/nvmeof/{node_id}
    node_concurrency: int = 16  # concurrent RPCs a storage node serves
    # A storage node's process is non-dumpable: no process of its OS user reads its memory
    # or descriptors through /proc or ptrace (docs/security.md). False: debuggers and py-spy
    # may attach (and so may every process of that user).
    private_node_memory: bool = True
    # A client without a tenant secret is the default tenant (the service's geometry, no
    # quota) while no named tenant exists; False: every client presents a tenant's secret
    # (docs/security.md). default_beside_tenants keeps it open beside named tenants too
    # (every Ray job then reads and writes the default tenant's pages).
    open_default: bool = True
    default_beside_tenants: bool = False
    # Per tenant and node (actors/tenant_limits.py): calls a second (0: no limit) and the
    # burst above that rate, leases held at once, puts open at once.
    tenant_calls_per_s: float = 20000.0
    tenant_call_burst: int = 5000
    tenant_leases: int = 4096
    tenant_puts: int = 256
    # The service secret (made on the first start, mode 0600); {namespace} is expanded.
    # Empty: FLATCAKE_SECRET_FILE of the process, else ~/.flatcake/{namespace}.secret.
    secret_file: str = ""

    def __post_init__(self) -> None:
        normalise(self)
        require(bool(self.namespace), "namespace must be non-empty", "namespace")
        require(bool(self.root), "root must be non-empty", "root")
        for name in ("ship_bytes", "landing_bytes"):
            require(
                getattr(self, name) >= ALIGN and getattr(self, name) % ALIGN == 0,
                f"{name} must be a positive multiple of {ALIGN}",
                name,
            )
        for name in ("lease_ttl_s", "rpc_timeout_s", "report_interval_s", "node_timeout_s"):
            require(getattr(self, name) > 0, f"{name} must be positive", name)
        require(self.node_down_s >= 0, "node_down_s must be >= 0", "node_down_s")
        require(
            self.tenant_calls_per_s >= 0,
            "tenant_calls_per_s must be >= 0 (0: no limit)",
            "tenant_calls_per_s",
        )
        for name in ("tenant_call_burst", "tenant_leases", "tenant_puts"):
            require(getattr(self, name) >= 1, f"{name} must be at least 1", name)
        require(self.ramp_seconds >= 0, "ramp_seconds must be >= 0", "ramp_seconds")
        require(0 < self.ramp_floor <= 1, "ramp_floor must be in (0, 1]", "ramp_floor")
        require(
            self.node_concurrency >= 2, "node_concurrency must be at least 2", "node_concurrency"
        )
        self.store_config("0" * 16, 1)  # the store's own checks, before any node starts

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given: Any) -> ServiceConfig:
        """Arguments first, then ``FLATCAKE_*`` variables on top of them."""
        return build_config(cls, Source.arguments(given), Source.environment(cls, environ))

    def store_config(
        self,
        ray_node_id: str,
        node_id: int,
        environ: Mapping[str, str] | None = None,
        slot: int = 0,
    ) -> StoreConfig:
        """This node's store: the service values, then the node's own ``FLATCAKE_*``; then
        the templates in ``root`` and ``ssd_dirs`` are expanded (module docstring), ``{slot}``
        to ``slot`` (so an overridden root with them still gives each node its own pool)."""
        service = {name: getattr(self, name) for name in STORE_FIELDS}
        return build_config(
            StoreConfig,
            Source.arguments(
                {**service, "node_id": node_id, "put_ttl_s": self.lease_ttl_s},
                name="service config",
            ),
            Source.environment(StoreConfig, environ),
            templates={
                "{node}": ray_node_id[:16],
                "{host}": host_name(),
                "{slot}": str(slot),
                "{namespace}": path_component(self.namespace),
            },
        )

    def check_same_geometry(self, running: Mapping[str, Any]) -> None:
        """Raise :class:`GeometryMismatchError` when ``running`` (a running service's
        :meth:`to_dict`) has another model geometry than this config."""
        differ = [n for n in GEOMETRY_FIELDS if running.get(n) != getattr(self, n)]
        if differ:
            theirs = ", ".join(f"{n}={running.get(n)}" for n in GEOMETRY_FIELDS)
            ours = ", ".join(f"{n}={getattr(self, n)}" for n in GEOMETRY_FIELDS)
            raise GeometryMismatchError(
                f"the service in namespace {self.namespace!r} runs with {theirs}; this start "
                f"asks for {ours}. Stop it first (flatcake-ray stop), or start with its "
                "geometry, or use another --namespace",
                *differ,
            )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def secret_path(self) -> str:
        return secret_path(self.namespace, self.secret_file)


@dataclass(frozen=True)
class ClientConfig:
    """A Ray client's own knobs; its process's ``FLATCAKE_*`` variables override them."""

    restore_windows: int = 2  # SSD restores streaming at once (FC-MAS prefetch budget)
    restore_slot_bytes: int = 16 << 20  # one staging slot of the restore pipeline
    staging_segment_bytes: int = 64 << 20  # NIXL put staging (remote owners) grows by this
    gds: str = "auto"  # GPUDirect Storage for local SSD reads into GPU memory: auto | on | off
    page_tokens: int = 256  # tokens a page holds (the engine's block size), for token metrics
    # Lookups, releases and a put's opening and commit to the node on this machine over a
    # socket, not a Ray actor call (client/direct.py); False: every call over Ray.
    direct_calls: bool = True
    # The same calls to nodes on other machines over TCP: the node connects to the client
    # (a port the system picks on the client's cluster address); False: over Ray.
    remote_direct_calls: bool = True
    # The tenant this client acts for (``flatcake-ray tenant add`` printed it); empty: the
    # service's open default tenant. Never printed.
    tenant_secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        require(self.page_tokens > 0, "page_tokens must be positive", "page_tokens")
        require(self.restore_windows >= 1, "restore_windows must be >= 1", "restore_windows")
        require(
            self.restore_slot_bytes % ALIGN == 0 and self.restore_slot_bytes >= 2 * ALIGN,
            f"restore_slot_bytes must be a multiple of {ALIGN}, at least {2 * ALIGN}",
            "restore_slot_bytes",
        )
        require(
            self.staging_segment_bytes >= ALIGN,
            f"staging_segment_bytes must be >= {ALIGN}",
            "staging_segment_bytes",
        )
        require(self.gds in ("auto", "on", "off"), "gds must be auto, on or off", "gds")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given: Any) -> ClientConfig:
        """Arguments first, then ``FLATCAKE_*`` variables on top of them."""
        return build_config(cls, Source.arguments(given), Source.environment(cls, environ))
