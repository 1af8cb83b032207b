"""Hardware and model profiles for the replay model, all overridable.

A profile describes one serving engine: a tensor-parallel group of ``ranks`` GPUs. All ranks
hold the same share of every page and move it over their own links at the same time, so the
model replays one rank: capacities are divided by ``ranks``, bandwidths are per rank.

Sources. ``deepseek-v4-flash-b200``: paper section 5.1 and Table 3 (43 layers, fp8 KV at
7.5 KiB per token per rank, 256-token pages, 1 TiB DRAM and 4 TiB SSD of KV budget, H2D
25-32 GB/s, GDS 5.5-6.5 GB/s per worker, 8 PM9A3 drives). ``llama-3.1-70b-a100``: the
model's geometry (80 layers, 8 KV heads of 128, bf16; TP4 gives 80 KiB per token per rank),
A100/PCIe Gen4 numbers. ``this-machine``: storage measured here by :func:`measure_this_machine`
(``flatcake-ray replay --measure``) on the project's 2-core VM (one virtio disk, ext4); it has
no GPU, so its compute and HBM figures are assumed for a small model on one small GPU.
Compute rates, HBM budgets and staging sizes are not given by the paper: they are stated
assumptions (``source`` says which), chosen so a 128K-token recompute costs what the paper's
Figures 2(c) and 10 suggest.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass, fields
from typing import Any, get_type_hints

import numpy as np

from flatcake_ray.config import ALIGN, parse_size
from flatcake_ray.errors import ConfigError

GIB = 1 << 30
TIB = 1 << 40
GB = 1e9


@dataclass(frozen=True)
class Profile:
    name: str
    layers: int
    kv_bytes_per_token: int  # per rank, all layers together
    page_tokens: int
    ranks: int
    hbm_kv_bytes: int  # per rank: the GPU prefix cache
    dram_bytes: int  # whole engine
    ssd_bytes: int  # whole engine
    h2d_gb_s: float  # per rank, host DRAM -> HBM (D2H assumed the same, full duplex)
    ssd_workers: int  # per rank, I/O submission threads
    ssd_worker_gb_s: float  # what one worker streams at best
    ssd_drives: int
    ssd_drive_gb_s: float  # per drive; the drives' sum, shared by all ranks, caps the workers
    ssd_command_us: float  # fixed cost of one read or write command (submission + device)
    host_staging_bytes: int  # per rank: tiered systems' host staging pool
    prefetch_windows: int  # concurrent SSD restores through the bounded GPU window (FlatCake)
    slot_bytes: int  # one staging slot: the largest coalesced read of a layer
    prefill_tokens_per_s: float  # linear (weights) part of prefill
    attention_pairs_per_s: float  # (query token, context token) pairs per second
    prefill_overhead_ms: float  # per dispatched request
    # Fixed cost of a restore that hits (lookup, lease, release, the pipeline's hand-offs),
    # on the request's way to its prefill; 0: not modelled (the live replay measures it).
    restore_overhead_ms: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        positive = [f.name for f in fields(self) if f.name not in ("name", "source")]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"profile field {name} must be a number >= 0, got {value!r}")
        for name in ("layers", "kv_bytes_per_token", "page_tokens", "ranks", "ssd_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"profile field {name} must be >= 1")
        for name in ("h2d_gb_s", "ssd_worker_gb_s", "ssd_drive_gb_s", "prefill_tokens_per_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"profile field {name} must be > 0")
        if self.attention_pairs_per_s <= 0 or self.prefetch_windows < 1:
            raise ConfigError("attention_pairs_per_s must be > 0 and prefetch_windows >= 1")
        if self.slot_bytes % ALIGN or self.slot_bytes < self.page_bytes + ALIGN:
            raise ConfigError(
                f"slot_bytes must be a multiple of {ALIGN} holding a page plus {ALIGN} bytes"
            )

    # ---- derived, per rank ---------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer (what the store calls ``page_bytes``)."""
        return max(1, round(self.page_tokens * self.kv_bytes_per_token / self.layers))

    @property
    def page_all_layers_bytes(self) -> int:
        return self.page_bytes * self.layers

    @property
    def dram_rank_bytes(self) -> int:
        return self.dram_bytes // self.ranks // ALIGN * ALIGN

    @property
    def ssd_rank_bytes(self) -> int:
        return self.ssd_bytes // self.ranks // ALIGN * ALIGN

    @property
    def ssd_worker_bytes_per_s(self) -> float:
        """A worker's rate once the drives' sum is shared by every worker of every rank."""
        shared = self.ssd_drives * self.ssd_drive_gb_s * GB / (self.ranks * self.ssd_workers)
        return min(self.ssd_worker_gb_s * GB, shared)

    def prefill_seconds(self, uncached_tokens: float, cached_tokens: float) -> float:
        """Linear work for the new tokens plus causal attention over the whole context."""
        if uncached_tokens <= 0:
            return self.prefill_overhead_ms / 1e3
        pairs = uncached_tokens * (cached_tokens + uncached_tokens / 2)
        return (
            self.prefill_overhead_ms / 1e3
            + uncached_tokens / self.prefill_tokens_per_s
            + pairs / self.attention_pairs_per_s
        )

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "page_bytes": self.page_bytes}


PROFILES: dict[str, Profile] = {
    "deepseek-v4-flash-b200": Profile(
        name="deepseek-v4-flash-b200",
        layers=43,
        kv_bytes_per_token=7680,
        page_tokens=256,
        ranks=8,
        hbm_kv_bytes=64 * GIB,
        dram_bytes=1 * TIB,
        ssd_bytes=4 * TIB,
        h2d_gb_s=28.0,
        ssd_workers=1,
        ssd_worker_gb_s=6.0,
        ssd_drives=8,
        ssd_drive_gb_s=6.9,
        ssd_command_us=20.0,
        host_staging_bytes=4 * GIB,
        prefetch_windows=2,
        slot_bytes=16 << 20,
        prefill_tokens_per_s=25_000.0,
        attention_pairs_per_s=2.7e9,
        prefill_overhead_ms=20.0,
        source="paper 5.1 + Table 3; HBM budget, staging, compute rates assumed",
    ),
    "llama-3.1-70b-a100": Profile(
        name="llama-3.1-70b-a100",
        layers=80,
        kv_bytes_per_token=80 * 1024,
        page_tokens=64,
        ranks=4,
        hbm_kv_bytes=30 * GIB,
        dram_bytes=512 * GIB,
        ssd_bytes=4 * TIB,
        h2d_gb_s=20.0,
        ssd_workers=1,
        ssd_worker_gb_s=3.5,
        ssd_drives=4,
        ssd_drive_gb_s=3.5,
        ssd_command_us=20.0,
        host_staging_bytes=4 * GIB,
        prefetch_windows=2,
        slot_bytes=16 << 20,
        prefill_tokens_per_s=4_500.0,
        attention_pairs_per_s=2.4e8,
        prefill_overhead_ms=20.0,
        source="model geometry; A100 PCIe Gen4, 4 Gen4 drives, compute rates assumed",
    ),
    "this-machine": Profile(
        name="this-machine",
        layers=24,
        kv_bytes_per_token=12 * 1024,
        page_tokens=64,
        ranks=1,
        hbm_kv_bytes=4 * GIB,
        dram_bytes=2 * GIB,
        ssd_bytes=32 * GIB,
        h2d_gb_s=6.2,
        ssd_workers=1,
        ssd_worker_gb_s=1.6,
        ssd_drives=1,
        ssd_drive_gb_s=1.6,
        ssd_command_us=154.0,
        host_staging_bytes=512 << 20,
        prefetch_windows=2,
        slot_bytes=16 << 20,
        prefill_tokens_per_s=20_000.0,
        attention_pairs_per_s=2e9,
        prefill_overhead_ms=5.0,
        source=(
            "memcpy 6.2 GB/s and O_DIRECT 1.6 GB/s + 154 us/command measured here "
            "(2-core VM, virtio ext4, queue depth 1); a 0.5B-class model, its GPU assumed"
        ),
    ),
}


def _coerce(name: str, hint: str, value: Any) -> Any:
    if isinstance(value, str):
        if name.endswith("_bytes"):
            return parse_size(value)
        if "int" in hint:
            return int(value)
        if "float" in hint:
            return float(value)
    if "float" in hint and isinstance(value, int):
        return float(value)
    return value


def get_profile(
    name: str | Profile, overrides: dict[str, Any] | None = None, capacity_scale: float = 1.0
) -> Profile:
    """A named profile with ``overrides`` (field -> value, sizes may be '64GiB') applied.

    ``capacity_scale`` multiplies the DRAM and SSD capacities, for a trace whose session count
    is scaled by ``f`` (``capacity_scale=f`` keeps its footprint-to-capacity ratio). HBM and
    host staging are left alone: they bound what one request and a few concurrent restores
    need, which a trace of fewer sessions does not shrink.
    """
    base = name if isinstance(name, Profile) else PROFILES.get(name)
    if base is None:
        raise ConfigError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")
    hints = {k: str(v) for k, v in get_type_hints(Profile).items()}
    changes: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        if key not in hints or key == "name":
            raise ConfigError(f"unknown profile field {key!r}; known: {', '.join(hints)}")
        try:
            changes[key] = _coerce(key, hints[key], value)
        except ValueError as exc:
            raise ConfigError(f"profile field {key}={value!r}: {exc}") from exc
    profile = dataclasses.replace(base, **changes)
    if capacity_scale != 1.0:
        if not capacity_scale > 0:
            raise ConfigError(f"capacity_scale must be > 0, got {capacity_scale}")
        scaled: dict[str, Any] = {
            key: max(ALIGN, int(getattr(profile, key) * capacity_scale) // ALIGN * ALIGN)
            for key in ("dram_bytes", "ssd_bytes")
        }
        profile = dataclasses.replace(profile, **scaled)
    return profile


def measure_this_machine(folder: str | None = None, seconds: float = 0.5) -> dict[str, float]:
    """memcpy GB/s and O_DIRECT read GB/s + per-command microseconds, at queue depth 1.

    The command cost and bandwidth come from a two-point fit (64 KiB and 8 MiB reads).
    """
    source = np.ones(128 << 20, dtype=np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)
    start = time.perf_counter()
    for _ in range(4):
        np.copyto(target, source)
    memcpy = 4 * source.nbytes / (time.perf_counter() - start) / GB
    small, large = 64 << 10, 8 << 20
    per_command = _odirect_seconds(folder, (small, large), seconds)
    bandwidth = (large - small) / max(per_command[1] - per_command[0], 1e-9)
    command_us = max(0.0, per_command[0] - small / bandwidth) * 1e6
    return {"h2d_gb_s": memcpy, "ssd_worker_gb_s": bandwidth / GB, "ssd_command_us": command_us}


def _odirect_seconds(folder: str | None, sizes: tuple[int, ...], seconds: float) -> list[float]:
    file_bytes = 256 << 20
    with tempfile.NamedTemporaryFile(dir=folder, delete=False) as handle:
        path = handle.name
        chunk = os.urandom(1 << 20)
        for _ in range(file_bytes >> 20):
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            return [_time_reads(fd, size, file_bytes, seconds) for size in sizes]
        finally:
            os.close(fd)
    finally:
        os.remove(path)


def _time_reads(fd: int, size: int, file_bytes: int, seconds: float) -> float:
    # Private memory, as the live service reads into (``media/buffers.py``): numpy has the
    # kernel back a large array with huge pages, and a drive streams faster into those than
    # into 4 KiB shared pages (1.8 against 3.0 GB/s on a virtio disk). Page aligned for O_DIRECT.
    raw = np.empty(size + ALIGN, dtype=np.uint8)
    buffer = raw[(-raw.ctypes.data) % ALIGN :][:size]
    count, offset, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        os.preadv(fd, [memoryview(buffer)], offset)
        count += 1
        offset = (offset + size) % file_bytes
    return (time.perf_counter() - start) / count
