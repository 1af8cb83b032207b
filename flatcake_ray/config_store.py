"""One node's store config (:class:`StoreConfig`, with its :class:`PlacementConfig`) and the
checks every config class shares (:func:`require`, :data:`ALIGN`).

Kept apart from the service's and a client's config (``config.py``) because the store's is
what the lower floors read: the pure core (catalog, placement, allocation) and a node's media
are sized by these fields alone, while a :class:`~flatcake_ray.config.ServiceConfig` is only
the source a node derives its :class:`StoreConfig` from. ``config.py`` re-exports the two
classes and :data:`ALIGN`, so callers keep importing them from ``flatcake_ray.config``; the
``FLATCAKE_<FIELD>`` overrides and value syntax its docstring describes hold here too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flatcake_ray.config_sources import Source, build_config, normalise
from flatcake_ray.errors import ConfigError
from flatcake_ray.gva_bits import MAX_NODE_ID, MAX_OFFSET

__all__ = [
    "ALIGN",
    "DRAM_POLICIES",
    "MAX_DRAM_CHUNKS",
    "PlacementConfig",
    "StoreConfig",
    "require",
]

ALIGN = 4096  # O_DIRECT and cuFile alignment
MAX_DRAM_CHUNKS = 4096


def require(condition: bool, message: str, *names: str) -> None:
    if not condition:
        raise ConfigError(message, *names)


def _align_up(value: int) -> int:
    return -(-value // ALIGN) * ALIGN


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
        normalise(self)
        for name in ("page_tokens", "tau_tokens", "l_agent_tokens"):
            require(getattr(self, name) > 0, f"{name} must be positive", name)
        require(
            self.dram_policy in DRAM_POLICIES,
            f"dram_policy must be one of {DRAM_POLICIES}",
            "dram_policy",
        )


@dataclass(frozen=True)
class StoreConfig:
    """One node's store: geometry of a page, sizes of both media and policy knobs."""

    root: str  # folder for the arena's fallback file name and the default SSD folder
    layers: int
    page_bytes: int  # bytes of one page of one layer
    node_id: int = 0
    dram_bytes: int = 256 << 20
    # The arena in this many chunks, each its own file; more than one: each chunk holds one
    # tenant's pages at a time (core/extents.py), and a DRAM segment fits one chunk.
    dram_chunks: int = 1
    ssd_dirs: tuple[str, ...] = ()  # one folder per drive; empty: <root>/ssd
    ssd_files_per_dir: int = 4
    ssd_file_bytes: int = 256 << 20
    ssd_min_run_bytes: int = 1 << 20  # smallest run a new SSD scope reserves in a pool file
    # Write zeros once, in the background, over pool space the file system allocated but never
    # wrote: first puts then overwrite written blocks (1.7x faster on ext4) instead of
    # converting unwritten extents (media/pool_prewrite.py). Costs one write of the pool.
    ssd_prewrite: bool = False
    # Each prewrite step waits while others read or write the drive (at most a second), so
    # the prewrite takes the drive's idle time, not live restores' and puts'. Off: as fast as
    # the drive goes (benches, which wait for it before timing on machines others share).
    ssd_prewrite_paced: bool = True
    gap_bytes: int = 64 << 10  # coalescing bridges holes smaller than this
    max_read_bytes: int = 32 << 20  # one coalesced read is at most this long
    # DRAM past high_watermark frees its oldest unreferenced scopes down to low_watermark, so
    # the headroom that admission and read replicas look for is there before the next put.
    high_watermark: float = 0.90
    low_watermark: float = 0.80
    # SSD has no headroom rule to feed, and a write-once pool of mostly-never-reused turns
    # sits at its high watermark: a band frees scopes that were coming back (the chat replay:
    # 96.8% of reusable pages at 0.90/0.80, 99.6% on demand, docs/bench_replay.md). 1.0/1.0
    # frees only what a put needs.
    ssd_high_watermark: float = 1.0
    ssd_low_watermark: float = 1.0
    hugepages: str = "auto"  # auto | off | require
    fsync: bool = True  # data reaches the drive before its manifest record does
    # Readers check DRAM blocks too (SSD blocks always). Off for a store only its own process
    # writes; a service's nodes turn it on (ServiceConfig.verify_dram).
    verify_dram: bool = False
    check_bytes: int = 64 << 10  # a checksum block: whole pages, about this many bytes
    restore_windows: int = 2  # SSD restores streaming at once (FC-MAS prefetch budget)
    restore_slot_bytes: int = 16 << 20  # one staging slot; a window holds two
    gds: str = "auto"  # GPUDirect Storage for SSD reads into GPU memory: auto | on | off
    put_ttl_s: float = 60.0  # a put not written to for this long is aborted (writer gone)
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    def __post_init__(self) -> None:
        normalise(self)
        require(bool(self.root), "root must be non-empty", "root")
        require(self.layers > 0, "layers must be positive", "layers")
        require(self.page_bytes > 0, "page_bytes must be positive", "page_bytes")
        require(0 <= self.node_id <= MAX_NODE_ID, f"node_id must be in 0..{MAX_NODE_ID}", "node_id")
        require(
            self.dram_bytes % ALIGN == 0,
            f"dram_bytes must be a non-negative multiple of {ALIGN}",
            "dram_bytes",
        )
        require(
            1 <= self.dram_chunks <= MAX_DRAM_CHUNKS,
            f"dram_chunks must be in 1..{MAX_DRAM_CHUNKS}",
            "dram_chunks",
        )
        require(
            self.ssd_files_per_dir >= 1, "ssd_files_per_dir must be at least 1", "ssd_files_per_dir"
        )
        self._check_ssd_sizes()
        require(self.gap_bytes >= 0, "gap_bytes must be >= 0", "gap_bytes")
        require(
            self.max_read_bytes >= ALIGN and self.max_read_bytes % ALIGN == 0,
            f"max_read_bytes must be a positive multiple of {ALIGN}",
            "max_read_bytes",
        )
        require(
            0 < self.low_watermark <= self.high_watermark <= 1,
            "need 0 < low_watermark <= high_watermark <= 1",
            "low_watermark",
            "high_watermark",
        )
        require(
            0 < self.ssd_low_watermark <= self.ssd_high_watermark <= 1,
            "need 0 < ssd_low_watermark <= ssd_high_watermark <= 1",
            "ssd_low_watermark",
            "ssd_high_watermark",
        )
        require(
            self.hugepages in ("auto", "off", "require"),
            "hugepages must be auto, off or require",
            "hugepages",
        )

    @property
    def dram_chunk_bytes(self) -> int:
        """Bytes of one arena chunk (the last may be shorter); 0 without an arena."""
        return _align_up(-(-self.dram_bytes // self.dram_chunks))

    def _check_ssd_sizes(self) -> None:
        require(
            self.ssd_file_bytes > 0 and self.ssd_file_bytes % ALIGN == 0,
            f"ssd_file_bytes must be a positive multiple of {ALIGN}",
            "ssd_file_bytes",
        )
        require(
            len(set(self.ssd_dirs)) == len(self.ssd_dirs),
            "ssd_dirs lists a folder twice",
            "ssd_dirs",
        )
        pool_bytes = self.ssd_file_bytes * self.ssd_files_per_dir * max(1, len(self.ssd_dirs))
        require(
            pool_bytes <= MAX_OFFSET and self.dram_bytes <= MAX_OFFSET,
            "a medium larger than 256 TiB does not fit a 48-bit offset",
            "dram_bytes",
            "ssd_file_bytes",
            "ssd_files_per_dir",
        )
        require(
            self.ssd_min_run_bytes > 0 and self.ssd_min_run_bytes % ALIGN == 0,
            f"ssd_min_run_bytes must be a positive multiple of {ALIGN}",
            "ssd_min_run_bytes",
        )
        page_span = self.layers * _align_up(self.page_bytes)  # one page of every layer
        require(
            page_span <= self.ssd_file_bytes,
            f"one page of every layer ({self.layers} x {self.page_bytes} bytes, 4 KiB aligned) "
            f"must fit one SSD pool file of {self.ssd_file_bytes} bytes",
            "layers",
            "page_bytes",
            "ssd_file_bytes",
        )
        require(self.check_bytes > 0, "check_bytes must be positive", "check_bytes")
        require(self.restore_windows >= 1, "restore_windows must be >= 1", "restore_windows")
        require(
            self.restore_slot_bytes % ALIGN == 0
            and self.restore_slot_bytes >= self.page_bytes + ALIGN,
            f"restore_slot_bytes must be a multiple of {ALIGN} holding a page plus {ALIGN} bytes",
            "restore_slot_bytes",
        )
        require(self.gds in ("auto", "on", "off"), "gds must be auto, on or off", "gds")
        require(self.put_ttl_s > 0, "put_ttl_s must be positive", "put_ttl_s")

    @property
    def ssd_folders(self) -> tuple[str, ...]:
        return self.ssd_dirs or (os.path.join(self.root, "ssd"),)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given: Any) -> StoreConfig:
        """Arguments first, then ``FLATCAKE_*`` variables on top of them."""
        return build_config(cls, Source.arguments(given), Source.environment(cls, environ))
