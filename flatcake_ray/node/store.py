"""FlatCakeStore: one node's flat DRAM+SSD KV store, in process (a :class:`KVStore`).

The storage actor of the Ray service wraps one of these; engines on one box, tests and the
demo use it directly.

- ``begin_put(keys)`` -> :class:`PutHandle`: ``write_layer`` each layer, then ``commit``, so an
  engine saves as layers finish without buffering the context; ``put(keys, kv)`` does the
  same for a ``[layers, len(keys), page_elems]`` buffer. Stored keys are skipped (write-once);
  the rest become one layer-major segment on the medium placement picks, published after the
  bytes and their manifest record are written.
- ``exists(keys)`` / ``probe(keys)``: consecutive hits from the first key (and whether any is
  on SSD).
- ``restore(keys, dest)``: a layer-pipelined restore through the store's
  :class:`RestorePipeline` (one per device); ``get(keys, out)`` waits for one into a
  ``[layers, pages, page_elems]`` buffer and returns how many pages are valid.

One process owns a store root at a time (a lock file): a second opener gets
:class:`StoreInUseError` instead of allocating the same extents twice.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flatcake_ray.config import StoreConfig
from flatcake_ray.core.api import Probe, PutResult
from flatcake_ray.core.catalog import Catalog, Lease, PutHints, Scope, Segment
from flatcake_ray.core.gva import SSD_FLOOR, Medium
from flatcake_ray.core.gva import encode as encode_gva
from flatcake_ray.core.keys import (
    DIGEST_DTYPE,
    KeyLike,
    PageKey,
    digest_keys,
    namespace_of,
    split_namespace,
)
from flatcake_ray.core.parts import LeasePart, lease_parts
from flatcake_ray.cuda_ext.scatter import LAYER_FIRST, Layout
from flatcake_ray.errors import ShapeError, StoreClosedError, StoreInUseError
from flatcake_ray.media.arena import DramArena
from flatcake_ray.media.buffers import as_page_bytes
from flatcake_ray.media.pool import SsdPool
from flatcake_ray.metrics.record import Metrics
from flatcake_ray.node.manifest import Manifest
from flatcake_ray.node.put import PutHandle
from flatcake_ray.node.puts import PutTable
from flatcake_ray.node.source import NodeSource
from flatcake_ray.node.writer import SegmentWriter
from flatcake_ray.restore.dest import PagedPool, as_destination
from flatcake_ray.restore.pipeline import RestorePipeline
from flatcake_ray.restore.source import Leased, ReadOutcome

__all__ = ["FlatCakeStore", "PutHandle", "PutHints", "PutResult"]

Keys = Sequence[KeyLike | PageKey]
LOCK_NAME = ".flatcake.lock"
_COUNTERS = (
    "puts",
    "gets",
    "ssd_read_commands",
    "ssd_bytes_read",
    "dram_bytes_read",
    "bytes_delivered",
    "ssd_bytes_written",
    "dram_bytes_written",
    "ssd_write_commands",
    "hit_pages",
    "miss_pages",
    "checksum_failures",
    "write_failures",
)


class FlatCakeStore:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.catalog = Catalog(config)
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.metrics = Metrics(
            node_id=config.node_id,
            layers=config.layers,
            page_bytes=config.page_bytes,
            page_tokens=config.placement.page_tokens,
        )
        self._lock = threading.RLock()
        self._closed = False
        self._pipelines: dict[torch.device, RestorePipeline] = {}
        self.puts = PutTable(config.put_ttl_s)
        with ExitStack() as undo:  # a failed open leaves no fd, arena or lock behind
            self._lock_fd = _lock_root(Path(config.root))
            undo.callback(os.close, self._lock_fd)
            root_slug = Path(config.root).resolve().as_posix().strip("/").replace("/", "-")
            self.arena = DramArena(
                config.dram_bytes, f"{root_slug}-{config.node_id}", config.hugepages
            )
            undo.callback(self.arena.close)
            self.pool = SsdPool(config.ssd_folders, config.ssd_files_per_dir, config.ssd_file_bytes)
            undo.callback(self.pool.close)
            self.manifest = Manifest(
                str(Path(config.ssd_folders[0]) / "manifest.fcm"), self._header(), config.fsync
            )
            undo.callback(self.manifest.close)
            self._recover()
            self.source = NodeSource(self)
            undo.pop_all()
        self.catalog.on_free = self._log_free
        self.writer = SegmentWriter(
            self.catalog,
            self._lock,
            self.arena,
            self.pool,
            self.manifest,
            self.counters,
            fsync=config.fsync,
            check_open=self._check_open,
        )

    @property
    def layers(self) -> int:
        return self.config.layers

    @property
    def page_bytes(self) -> int:
        return self.config.page_bytes

    # ---- lifecycle -----------------------------------------------------------------------
    def _header(self) -> dict[str, Any]:
        config = self.config
        return {
            "layers": config.layers,
            "page_bytes": config.page_bytes,
            "check_pages": self.catalog.layout_for(1).check_pages,
            "file_bytes": config.ssd_file_bytes,
            "files": len(self.pool.paths),
        }

    def _recover(self) -> None:
        highest = 0
        for scope in self.manifest.recovered.values():
            segments = [self._segment_from_record(r) for r in scope.segments]
            self.catalog.adopt_scope(scope.scope_id, scope.session_id, scope.runs, segments)
            highest = max([highest, scope.scope_id, *(s.segment_id for s in segments)])
        self.catalog.skip_ids_below(highest + 1)

    def _log_free(self, scope: Scope) -> None:
        if scope.medium is Medium.SSD:
            self.manifest.append({"t": "free", "scope": scope.scope_id})

    def _segment_from_record(self, record: dict[str, Any]) -> Segment:
        layout = self.catalog.layout_for(record["pages"])
        digests = np.frombuffer(record["digests"], dtype=DIGEST_DTYPE).copy()
        checksums = np.frombuffer(record["checksums"], dtype=np.uint64).copy()
        checksums = checksums.reshape(layout.layers, layout.blocks)
        return Segment(
            record["segment"],
            record["scope"],
            Medium.SSD,
            record["offset"],
            layout,
            digests,
            checksums,
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pipelines = list(self._pipelines.values())
        for pipeline in pipelines:
            pipeline.close()
        self.puts.abort_all()
        self.source.close()
        self.manifest.close()
        self.pool.close()
        self.arena.close()
        os.close(self._lock_fd)  # closing the descriptor releases its flock

    def __enter__(self) -> FlatCakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    def _digests(self, keys: Keys, namespace: str | None) -> np.ndarray:
        resolved, bare = split_namespace(keys, namespace)
        return digest_keys(resolved, bare)

    # ---- writes --------------------------------------------------------------------------
    def begin_put(
        self,
        keys: Keys,
        *,
        namespace: str | None = None,
        session_id: str | None = None,
        parent: KeyLike | PageKey | None = None,
        hints: PutHints | None = None,
    ) -> PutHandle:
        self._check_open()
        if len(keys) == 0:
            raise ShapeError("a put needs at least one key")
        extra = [parent] if parent is not None else []
        resolved, bare = split_namespace([*keys, *extra], namespace)
        digests = digest_keys(resolved, bare)
        parent_digest = digests[len(keys) :] if parent is not None else None
        self.puts.expire(time.monotonic())
        with self._lock:
            self._check_open()
            plan = self.catalog.plan_put(
                digests[: len(keys)], session_id=session_id, parent=parent_digest, hints=hints
            )
        config = self.config
        on_commit = partial(self.metrics.put_committed, namespace_of(keys, namespace))
        return PutHandle(
            self.writer, plan, len(keys), config.layers, config.page_bytes, self.puts, on_commit
        )

    def put(self, keys: Keys, kv: Any, **options: Any) -> PutResult:
        pages, _ = as_page_bytes(
            kv, self.layers, self.page_bytes, min_pages=len(keys), writable=False, what="kv"
        )
        if pages.shape[1] != len(keys):
            raise ShapeError(f"kv holds {pages.shape[1]} pages for {len(keys)} keys")
        with self.begin_put(keys, **options) as handle:
            for layer in range(self.config.layers):
                handle.write_pages(layer, 0, np.ascontiguousarray(pages[layer]))
            return handle.commit()

    # ---- reads ---------------------------------------------------------------------------
    def exists(self, keys: Keys, *, namespace: str | None = None) -> int:
        self._check_open()
        digests = self._digests(keys, namespace)
        with self._lock:
            hits = self.catalog.index.prefix_length(digests)
        self.metrics.probed(namespace_of(keys, namespace), len(keys), hits)
        return hits

    def probe(self, keys: Keys, *, namespace: str | None = None) -> Probe:
        found = self.gvas(keys, namespace=namespace)
        self.metrics.probed(namespace_of(keys, namespace), len(keys), len(found))
        return Probe(len(found), bool(len(found)) and int(found.max()) >= SSD_FLOOR)

    def lease(self, keys: Keys, *, namespace: str | None = None) -> Lease:
        """Locate the consecutive hits and pin their scopes; pair with :meth:`release`."""
        self._check_open()
        self.puts.expire(time.monotonic())
        digests = self._digests(keys, namespace)
        with self._lock:
            return self.catalog.lease(digests)

    def release(self, lease: Lease) -> None:
        with self._lock:
            self.catalog.release(lease)

    def pipeline(self, device: str | torch.device = "cpu") -> RestorePipeline:
        """The store's restore pipeline for destinations on ``device`` (made on first use)."""
        key = torch.device(device)
        with self._lock:
            self._check_open()
            if key not in self._pipelines:
                self._pipelines[key] = RestorePipeline(
                    self.source,
                    windows=self.config.restore_windows,
                    slot_bytes=self.config.restore_slot_bytes,
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
    ):
        """Start a layer-pipelined restore of ``keys`` into ``dest``; see ``RestorePipeline``."""
        destination = as_destination(dest, slot_ids, layout)
        return self.pipeline(destination.device).submit(keys, destination, namespace=namespace)

    def get(self, keys: Keys, out: Any, *, namespace: str | None = None) -> int:
        """Restore the consecutive hits into ``out`` (``[layers, >= len(keys), page_elems]``,
        numpy or torch) and return how many pages from the first are valid."""
        self._check_open()
        pool = PagedPool(out, np.arange(len(keys)), LAYER_FIRST)
        restored = self.pipeline(pool.device).submit(keys, pool, namespace=namespace).wait()
        with self._lock:
            self.counters["gets"] += 1
            self.counters["miss_pages"] += len(keys) - restored
        return restored

    def restore_lease(self, lease: Lease, dest: Any):
        """Restore a prefix leased with :meth:`lease` into ``dest``; the restore takes the
        lease over and releases it when it ends."""
        leased = Leased(lease.hits, lease_parts(lease), lease)
        return self.pipeline(dest.device).submit_leased(leased, dest)

    def recheck(self, lease: Lease, scope_ids: set[int]) -> None:
        """Read the leased pages of ``scope_ids`` again here, verifying every block (a remote
        reader saw a bad checksum: if the medium really is bad, this quarantines the scope).
        Consumes the lease: it is released when the re-read ends."""
        parts = [p for p in lease_parts(lease) if p.scope_id in scope_ids]
        pages = sum(p.pages for p in parts)
        renumbered, at = [], 0
        for part in parts:
            positions = np.arange(at, at + part.pages, dtype=np.int64)
            renumbered.append(_with_positions(part, positions))
            at += part.pages
        scratch = np.empty((self.layers, pages, self.page_bytes), dtype=np.uint8)
        dest = PagedPool(scratch, np.arange(pages), LAYER_FIRST)
        self.pipeline().submit_leased(Leased(pages, tuple(renumbered), lease), dest).wait()

    def account_read(self, outcome: ReadOutcome) -> None:
        """Count a restore's reads and quarantine the scopes whose checksums failed."""
        with self._lock:
            self.counters["ssd_read_commands"] += outcome.commands.get(Medium.SSD, 0)
            self.counters["ssd_bytes_read"] += outcome.bytes_read.get(Medium.SSD, 0)
            self.counters["dram_bytes_read"] += outcome.bytes_wanted.get(Medium.DRAM, 0)
            self.counters["hit_pages"] += outcome.pages
            self.counters["bytes_delivered"] += outcome.pages * self.layers * self.page_bytes
            for scope_id in outcome.bad_scopes:
                self._quarantine(scope_id)

    def _quarantine(self, scope_id: int) -> None:
        scope = self.catalog.scopes.get(scope_id)
        if scope is None:
            return
        runs = [[r.allocator, r.start, r.length, r.used] for r in scope.runs.runs]
        self.counters["checksum_failures"] += 1
        self.catalog.quarantine(scope_id)
        if scope.medium is Medium.SSD:
            self.manifest.append({"t": "quarantine", "scope": scope_id, "runs": runs})

    def gvas(self, keys: Keys, *, namespace: str | None = None) -> np.ndarray:
        """The layer-0 GVA of each consecutive hit (per-layer GVAs follow the layout)."""
        digests = self._digests(keys, namespace)
        with self._lock:
            segment_ids, pages = self.catalog.prefix(digests)
            out = np.empty(len(pages), dtype=np.uint64)
            for i, (segment_id, page) in enumerate(zip(segment_ids, pages, strict=True)):
                segment = self.catalog.segments[int(segment_id)]
                offset = segment.offset + int(page) * segment.layout.page_bytes
                out[i] = encode_gva(segment.medium, self.config.node_id, offset)
        return out

    # ---- stats ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            catalog = self.catalog
            pages = len(catalog.index)
            key_copies = sum(s.digests.nbytes for s in catalog.segments.values())
            index_bytes = catalog.index.nbytes + key_copies
            ssd, dram = catalog.space[Medium.SSD], catalog.space[Medium.DRAM]
            ssd_scopes = [s for s in catalog.scopes.values() if s.medium is Medium.SSD]
            reserved = sum(s.runs.reserved_bytes for s in ssd_scopes)
            used = sum(s.runs.used_bytes for s in ssd_scopes)
            stats = {
                **self.counters,
                **catalog.counters,
                **self.manifest.report.counters(),
                "pages_indexed": pages,
                "index_bytes": index_bytes,
                "index_bytes_per_page": index_bytes / pages if pages else 0.0,
                "scopes": len(catalog.scopes),
                "sessions": len(catalog.sessions),
                "segments": len(catalog.segments),
                "dram_capacity": dram.capacity,
                "dram_used": dram.capacity - dram.free_bytes,
                "ssd_capacity": ssd.capacity,
                "ssd_reserved": reserved,
                "ssd_used": used,
                "ssd_pool_utilisation": used / reserved if reserved else 1.0,
                "placement_rules": dict(catalog.rule_counts),
                "leases_open": len(catalog.leases),
                "puts_open": len(self.puts),
                "puts_expired": self.puts.expired,
                "arena_path": self.arena.path,
                "arena_hugepages": self.arena.huge,
                "ssd_o_direct": self.pool.direct,
            }
            self.metrics.node_state(stats, catalog.scopes)
        return {**stats, "metrics": self.metrics.snapshot()}


def _with_positions(part: LeasePart, positions: np.ndarray) -> LeasePart:
    return LeasePart(
        part.scope_id,
        part.medium,
        part.offset,
        part.layout,
        part.checksums,
        part.src_pages,
        positions,
    )


def _lock_root(root: Path) -> int:
    """Hold ``root``'s lock file for as long as the store is open (flock: released when the
    process dies, so a crash never leaves a root locked)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise StoreInUseError(
            f"store root {root} is in use by another store (this process or another); an "
            "engine whose scheduler and workers run in separate processes reaches one store "
            "with store: ray"
        ) from exc
    return fd
