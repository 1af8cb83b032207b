"""FlatCakeStore: one node's flat DRAM+SSD KV store, in process.

The storage actor of the Ray service wraps one of these; tests and the demo use it directly.

- ``put(keys, kv)``: ``kv`` is ``[layers, len(keys), page_elems]`` (numpy or torch). Pages whose
  keys are stored are skipped (write-once); the rest become one layer-major segment on the
  medium the placement policy picks, and their keys are published after the bytes are written.
- ``begin_put(keys)`` -> :class:`PutHandle`: the same, a layer at a time (``write_layer``,
  then ``commit``), so an engine can save as layers finish without buffering the context.
- ``exists(keys)``: consecutive hits from the first key.
- ``get(keys, out)``: restores the consecutive hits into ``out`` and returns how many.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flatcake_ray.config import StoreConfig
from flatcake_ray.core.catalog import Catalog, Lease, PutHints, PutPlan, Scope, Segment
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.gva import encode as encode_gva
from flatcake_ray.core.keys import DIGEST_DTYPE, KeyLike, PageKey, digest_keys, split_namespace
from flatcake_ray.core.layout import SegmentLayout
from flatcake_ray.errors import ShapeError, StoreClosedError
from flatcake_ray.media.arena import DramArena
from flatcake_ray.media.buffers import AlignedBuffer, as_page_bytes
from flatcake_ray.media.pool import SsdPool
from flatcake_ray.node.manifest import Manifest
from flatcake_ray.node.put import PutHandle, PutResult
from flatcake_ray.node.reader import ReadOutcome, SegmentReader, checksum

__all__ = ["FlatCakeStore", "PutHandle", "PutHints", "PutResult"]


Keys = Sequence[KeyLike | PageKey]


class FlatCakeStore:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.catalog = Catalog(config)
        Path(config.root).mkdir(parents=True, exist_ok=True)
        root_slug = Path(config.root).resolve().as_posix().strip("/").replace("/", "-")
        arena_name = f"{root_slug}-{config.node_id}"
        self.arena = DramArena(config.dram_bytes, arena_name, config.hugepages)
        self.pool = SsdPool(config.ssd_folders, config.ssd_files_per_dir, config.ssd_file_bytes)
        self.reader = SegmentReader(config, self.arena, self.pool)
        self._lock = threading.RLock()
        self._closed = False
        self.counters = dict.fromkeys(
            (
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
            ),
            0,
        )
        self.manifest = Manifest(
            str(Path(config.ssd_folders[0]) / "manifest.fcm"),
            {
                "layers": config.layers,
                "page_bytes": config.page_bytes,
                "file_bytes": config.ssd_file_bytes,
                "files": len(self.pool.paths),
            },
            fsync=config.fsync,
        )
        self._recover()
        self.catalog.on_free = self._log_free

    # ---- lifecycle -----------------------------------------------------------------------
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
        layout = SegmentLayout(record["pages"], self.config.layers, self.config.page_bytes)
        digests = np.frombuffer(record["digests"], dtype=DIGEST_DTYPE).copy()
        checksums = np.frombuffer(record["checksums"], dtype=np.uint64).copy()
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
            self.reader.close()
            self.manifest.close()
            self.pool.close()
            self.arena.close()

    def __enter__(self) -> FlatCakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    def _page_view(self, array: Any, pages: int, *, writable: bool, what: str):
        """A caller's [layers, pages, page_elems] buffer as bytes, checked against this store."""
        config = self.config
        return as_page_bytes(
            array, config.layers, config.page_bytes, min_pages=pages, writable=writable, what=what
        )

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
        resolved, bare = split_namespace(
            [*keys, *([parent] if parent is not None else [])], namespace
        )
        digests = digest_keys(resolved, bare)
        parent_digest = digests[len(keys) :] if parent is not None else None
        with self._lock:
            self._check_open()
            plan = self.catalog.plan_put(
                digests[: len(keys)], session_id=session_id, parent=parent_digest, hints=hints
            )
        return PutHandle(self, plan, len(keys))

    def put(self, keys: Keys, kv: Any, **options: Any) -> PutResult:
        pages, _ = self._page_view(kv, len(keys), writable=False, what="kv")
        if pages.shape[1] != len(keys):
            raise ShapeError(f"kv holds {pages.shape[1]} pages for {len(keys)} keys")
        handle = self.begin_put(keys, **options)
        with handle:
            for layer in range(self.config.layers):
                handle.write_layer(layer, pages[layer])
            return handle.commit()

    def _write_layer(
        self, plan: PutPlan, layer: int, pages: np.ndarray, staging: AlignedBuffer | None
    ) -> None:
        segment = plan.segment
        layout = segment.layout
        chosen = pages[plan.new_positions]
        start = segment.offset + layout.layer_offset(layer)
        if segment.medium is Medium.DRAM:
            self.arena.write(start, chosen)
            segment.checksums[layer] = checksum(self.arena.view[start : start + layout.layer_bytes])
            self.counters["dram_bytes_written"] += layout.layer_bytes
            return
        assert staging is not None
        staging.array[: layout.layer_bytes] = chosen.reshape(-1)
        staging.array[layout.layer_bytes : layout.layer_stride] = 0
        segment.checksums[layer] = checksum(staging.array[: layout.layer_bytes])
        self.pool.write(start, staging.array[: layout.layer_stride])
        self.counters["ssd_bytes_written"] += layout.layer_stride
        self.counters["ssd_write_commands"] += 1
        if plan.replica is not None:  # a DRAM read replica of the same bytes (placement.py)
            self.arena.write(plan.replica.offset + layout.layer_offset(layer), chosen)
            self.counters["dram_bytes_written"] += layout.layer_bytes

    def _commit(self, plan: PutPlan) -> PutResult:
        segment = plan.segment
        if segment.medium is Medium.SSD and self.config.fsync:
            self.pool.sync(segment.offset)
        with self._lock:
            self._check_open()
            published = self.catalog.publish(plan)
            if segment.medium is Medium.SSD:
                self.manifest.append(self._segment_record(plan))
            self.counters["puts"] += 1
        written = int(published.sum())
        return PutResult(written, 0, segment.medium.name, plan.rule, plan.session_id)

    def _segment_record(self, plan: PutPlan) -> dict[str, Any]:
        segment = plan.segment
        scope = self.catalog.scopes[segment.scope_id]
        return {
            "t": "seg",
            "scope": scope.scope_id,
            "session": scope.session_id,
            "segment": segment.segment_id,
            "offset": segment.offset,
            "pages": segment.layout.pages,
            "digests": segment.digests.tobytes(),
            "checksums": segment.checksums.tobytes(),
            "runs": [[r.allocator, r.start, r.length, r.used] for r in scope.runs.runs],
        }

    def _abort(self, plan: PutPlan) -> None:
        with self._lock:
            self.catalog.abort(plan)
            self.counters["write_failures"] += 1

    # ---- reads ---------------------------------------------------------------------------
    def exists(self, keys: Keys, *, namespace: str | None = None) -> int:
        self._check_open()
        digests = self._digests(keys, namespace)
        with self._lock:
            return self.catalog.index.prefix_length(digests)

    def lease(self, keys: Keys, *, namespace: str | None = None) -> Lease:
        """Locate the consecutive hits and pin their scopes; pair with :meth:`release`."""
        self._check_open()
        digests = self._digests(keys, namespace)
        with self._lock:
            return self.catalog.lease(digests)

    def release(self, lease: Lease) -> None:
        with self._lock:
            self.catalog.release(lease)

    def read_leased(self, lease: Lease, out: np.ndarray, layers: Sequence[int]) -> ReadOutcome:
        """Read ``layers`` of a leased prefix into a uint8 [layers, pages, page_bytes] view."""
        outcome = self.reader.read(lease, out, layers)
        self.account_read(outcome)
        return outcome

    def account_read(self, outcome: ReadOutcome, *, delivered_pages: int = 0) -> None:
        """Count a read of leased pages (done here or by a restore pipeline) and quarantine
        the scopes whose checksums failed."""
        with self._lock:
            self.counters["ssd_read_commands"] += outcome.ssd_commands
            self.counters["ssd_bytes_read"] += outcome.ssd_bytes
            self.counters["dram_bytes_read"] += outcome.dram_bytes
            if delivered_pages:
                self.counters["hit_pages"] += delivered_pages
                self.counters["bytes_delivered"] += (
                    delivered_pages * self.config.layers * self.config.page_bytes
                )
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

    def get(self, keys: Keys, out: Any, *, namespace: str | None = None) -> int:
        self._check_open()
        view, finish = self._page_view(out, len(keys), writable=True, what="out")
        lease = self.lease(keys, namespace=namespace)
        try:
            outcome = self.read_leased(lease, view, range(self.config.layers))
        finally:
            self.release(lease)
        finish()
        restored = outcome.pages_ok
        with self._lock:
            self.counters["gets"] += 1
            self.counters["hit_pages"] += restored
            self.counters["miss_pages"] += len(keys) - restored
            self.counters["bytes_delivered"] += (
                restored * self.config.layers * self.config.page_bytes
            )
        return restored

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
            return {
                **self.counters,
                **catalog.counters,
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
                "ssd_used": sum(s.runs.used_bytes for s in ssd_scopes),
                "ssd_pool_utilisation": sum(s.runs.used_bytes for s in ssd_scopes) / reserved
                if reserved
                else 1.0,
                "placement_rules": dict(catalog.rule_counts),
                "leases_open": len(catalog.leases),
                "arena_path": self.arena.path,
                "arena_hugepages": self.arena.huge,
                "ssd_o_direct": self.pool.direct,
            }
