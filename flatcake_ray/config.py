"""Configuration: frozen dataclasses, validated with ValueError (:class:`ConfigError`).

Every field of :class:`StoreConfig` can be overridden by an environment variable named
``FLATCAKE_<FIELD>`` (upper case), e.g. ``FLATCAKE_DRAM_BYTES=4GiB``,
``FLATCAKE_SSD_DIRS=/mnt/nvme0/fc:/mnt/nvme1/fc``, ``FLATCAKE_TAU_TOKENS=2048``.
Sizes accept ``K/M/G/T`` (powers of 1024, ``KiB`` and ``KB`` alike); booleans accept
``1/0/true/false/yes/no``; tuples of paths are ``:``-separated.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

from flatcake_ray.core.gva import MAX_NODE_ID, MAX_OFFSET
from flatcake_ray.errors import ConfigError

ALIGN = 4096  # O_DIRECT and cuFile alignment
ENV_PREFIX = "FLATCAKE_"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """``"64KiB" -> 65536``; plain integers pass through."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ConfigError(f"cannot read {text!r} as a size (e.g. 512MiB, 4G, 65536)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"cannot read {text!r} as a boolean")


def _parse_field(name: str, hint: Any, text: str) -> Any:
    hint_text = str(hint)
    if "bool" in hint_text:
        return _parse_bool(text)
    if "tuple" in hint_text:
        return tuple(part for part in text.split(":") if part)
    if "float" in hint_text:
        return float(text)
    if "int" in hint_text:
        return parse_size(text) if name.endswith("bytes") else int(text)
    return text


def env_overrides(cls: type, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``FLATCAKE_*`` values that name fields of dataclass ``cls``, parsed."""
    environ = os.environ if environ is None else environ
    hints = get_type_hints(cls)
    found: dict[str, Any] = {}
    for item in fields(cls):
        raw = environ.get(ENV_PREFIX + item.name.upper())
        if raw is not None:
            try:
                found[item.name] = _parse_field(item.name, hints[item.name], raw)
            except (ValueError, ConfigError) as exc:
                raise ConfigError(f"{ENV_PREFIX}{item.name.upper()}={raw!r}: {exc}") from exc
    return found


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


DRAM_POLICIES = ("replica", "table2", "admit")


@dataclass(frozen=True)
class PlacementConfig:
    """Write-time placement (paper Table 2; the paper gives no thresholds) and how DRAM is
    used beyond it (``core/placement.py`` states the rules; ``docs/placement.md`` the
    measurements behind the default)."""

    page_tokens: int = 256
    tau_tokens: int = 1024  # a prior reply shorter than this marks a short-turn chat
    l_agent_tokens: int = 32768  # a context at least this long marks an agentic session
    # replica: SSD segments also keep a droppable DRAM read replica while DRAM has room;
    # table2: the paper's rules only; admit: SSD-bound later turns go to DRAM (no SSD copy)
    # while DRAM stays under its low watermark.
    dram_policy: str = "replica"

    def __post_init__(self) -> None:
        _require(self.page_tokens > 0, "page_tokens must be positive")
        _require(self.tau_tokens > 0, "tau_tokens must be positive")
        _require(self.l_agent_tokens > 0, "l_agent_tokens must be positive")
        _require(self.dram_policy in DRAM_POLICIES, f"dram_policy must be one of {DRAM_POLICIES}")


@dataclass(frozen=True)
class StoreConfig:
    """One node's store: geometry of a page, sizes of both media and policy knobs."""

    root: str  # folder for the arena's fallback file name and the default SSD folder
    layers: int
    page_bytes: int  # bytes of one page of one layer
    node_id: int = 0
    dram_bytes: int = 256 << 20
    ssd_dirs: tuple[str, ...] = ()  # one folder per drive; empty: <root>/ssd
    ssd_files_per_dir: int = 4
    ssd_file_bytes: int = 256 << 20
    ssd_min_run_bytes: int = 1 << 20  # smallest run a new SSD scope reserves in a pool file
    gap_bytes: int = 64 << 10  # coalescing bridges holes smaller than this
    max_read_bytes: int = 32 << 20  # one coalesced read is at most this long
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    hugepages: str = "auto"  # auto | off | require
    fsync: bool = True  # data reaches the drive before its manifest record does
    verify_dram: bool = False  # checksums are always checked on SSD reads
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    def __post_init__(self) -> None:
        _require(self.layers > 0, "layers must be positive")
        _require(self.page_bytes > 0, "page_bytes must be positive")
        _require(0 <= self.node_id <= MAX_NODE_ID, f"node_id must be in 0..{MAX_NODE_ID}")
        _require(
            self.dram_bytes >= 0 and self.dram_bytes % ALIGN == 0,
            f"dram_bytes must be a non-negative multiple of {ALIGN}",
        )
        _require(self.ssd_files_per_dir >= 0, "ssd_files_per_dir must be >= 0")
        _require(
            self.ssd_file_bytes > 0 and self.ssd_file_bytes % ALIGN == 0,
            f"ssd_file_bytes must be a positive multiple of {ALIGN}",
        )
        pool_bytes = self.ssd_file_bytes * self.ssd_files_per_dir * max(1, len(self.ssd_dirs))
        _require(
            pool_bytes <= MAX_OFFSET and self.dram_bytes <= MAX_OFFSET,
            "a medium larger than 256 TiB does not fit a 48-bit offset",
        )
        _require(
            self.ssd_min_run_bytes > 0 and self.ssd_min_run_bytes % ALIGN == 0,
            f"ssd_min_run_bytes must be a positive multiple of {ALIGN}",
        )
        _require(self.gap_bytes >= 0, "gap_bytes must be >= 0")
        _require(
            self.max_read_bytes >= ALIGN and self.max_read_bytes % ALIGN == 0,
            f"max_read_bytes must be a multiple of {ALIGN}",
        )
        _require(
            0 < self.low_watermark <= self.high_watermark <= 1,
            "need 0 < low_watermark <= high_watermark <= 1",
        )
        _require(
            self.hugepages in ("auto", "off", "require"), "hugepages must be auto, off or require"
        )

    @property
    def ssd_folders(self) -> tuple[str, ...]:
        return self.ssd_dirs or (os.path.join(self.root, "ssd"),)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given: Any) -> StoreConfig:
        """Arguments first, then ``FLATCAKE_*`` variables on top of them."""
        merged = {**given, **env_overrides(cls, environ)}
        placement_env = env_overrides(PlacementConfig, environ)
        if placement_env:
            base = merged.get("placement", PlacementConfig())
            merged["placement"] = dataclasses.replace(base, **placement_env)
        return cls(**merged)


@dataclass(frozen=True)
class ServiceConfig:
    """The service's knobs: the store geometry every node shares, per-node sizes (each node's
    ``FLATCAKE_*`` variables override them again for its own store), and service timings."""

    namespace: str = "flatcake"  # the Ray namespace of the coordinator and storage nodes
    root: str = "/var/tmp/flatcake/{node}"  # {node}: the Ray node id (one machine, many nodes)
    layers: int = 32
    page_bytes: int = 64 << 10
    dram_bytes: int = 1 << 30
    ssd_dirs: tuple[str, ...] = ()
    ssd_files_per_dir: int = 4
    ssd_file_bytes: int = 1 << 30
    hugepages: str = "auto"
    fsync: bool = True
    ship_bytes: int = 64 << 20  # each node's NIXL bounce buffer for shipped SSD reads
    lease_ttl_s: float = 60.0  # a lease not released by then is dropped (its reader is gone)
    rpc_timeout_s: float = 10.0  # a client waits this long for a node before calling it down
    node_down_s: float = 5.0  # ... and skips that node this long before trying it again
    report_interval_s: float = 2.0  # storage node -> coordinator capacity reports
    node_timeout_s: float = 10.0  # no report for this long: the coordinator stops placing there
    ramp_seconds: float = 60.0  # a newly joined node reaches its full share of new scopes
    ramp_floor: float = 0.1  # ... starting from this fraction of it
    nvmeof_root: str = ""  # where remote pools appear on this node, e.g. /mnt/nvmeof/{node_id}
    node_concurrency: int = 16  # concurrent RPCs a storage node serves

    def __post_init__(self) -> None:
        _require(bool(self.namespace), "namespace must be non-empty")
        _require(bool(self.root), "root must be non-empty")
        for name in ("lease_ttl_s", "rpc_timeout_s", "report_interval_s", "node_timeout_s"):
            _require(getattr(self, name) > 0, f"{name} must be positive")
        _require(self.node_down_s >= 0, "node_down_s must be >= 0")
        _require(self.ramp_seconds >= 0, "ramp_seconds must be >= 0")
        _require(0 < self.ramp_floor <= 1, "ramp_floor must be in (0, 1]")
        _require(
            self.ship_bytes >= ALIGN and self.ship_bytes % ALIGN == 0,
            f"ship_bytes must be a positive multiple of {ALIGN}",
        )
        _require(self.node_concurrency >= 2, "node_concurrency must be at least 2")
        self.store_config("0" * 16, 1)  # the store's own checks, before any node starts

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given: Any) -> ServiceConfig:
        """Arguments first, then ``FLATCAKE_*`` variables on top of them."""
        sizes = {k: parse_size(v) for k, v in given.items() if k.endswith("bytes")}
        return cls(**{**given, **sizes, **env_overrides(cls, environ)})

    def store_config(self, ray_node_id: str, node_id: int) -> StoreConfig:
        """This node's store: the service values, then the node's own ``FLATCAKE_*``."""
        return StoreConfig.from_env(
            root=self.root.format(node=ray_node_id[:16]),
            layers=self.layers,
            page_bytes=self.page_bytes,
            node_id=node_id,
            dram_bytes=self.dram_bytes,
            ssd_dirs=tuple(d.format(node=ray_node_id[:16]) for d in self.ssd_dirs),
            ssd_files_per_dir=self.ssd_files_per_dir,
            ssd_file_bytes=self.ssd_file_bytes,
            hugepages=self.hugepages,
            fsync=self.fsync,
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
