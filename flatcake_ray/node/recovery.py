"""What a store needs to reopen its root: the root's lock, the manifest's geometry header,
and the catalogs rebuilt from the manifest's surviving SSD scopes (warm restart)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import numpy as np

from flatcake_ray.config import StoreConfig
from flatcake_ray.core.catalog import Catalog, Segment
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.keys import DIGEST_DTYPE
from flatcake_ray.errors import StoreInUseError
from flatcake_ray.media.pool import SsdPool
from flatcake_ray.node.manifest import Manifest
from flatcake_ray.node.tenancy import Tenancy

LOCK_NAME = ".flatcake.lock"


def lock_root(root: Path) -> int:
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


def manifest_header(config: StoreConfig, pool: SsdPool) -> dict[str, Any]:
    """The geometry a manifest is only valid for (a reopen with another is refused)."""
    return {
        "layers": config.layers,
        "page_bytes": config.page_bytes,
        "file_bytes": config.ssd_file_bytes,
        "files": len(pool.paths),
    }


def recover(manifest: Manifest, tenancy: Tenancy, default: Catalog) -> None:
    """Adopt every SSD scope the manifest kept into its tenant's catalog, and move the id
    counter past every id they use."""
    highest = 0
    for scope in manifest.recovered.values():
        catalog = _recovered_catalog(tenancy, default, scope.segments)
        segments = [segment_from_record(catalog, r) for r in scope.segments]
        catalog.adopt_scope(scope.scope_id, scope.session_id, scope.runs, segments)
        highest = max([highest, scope.scope_id, *(s.segment_id for s in segments)])
    tenancy.ids.skip_below(highest + 1)


def _recovered_catalog(
    tenancy: Tenancy, default: Catalog, records: list[dict[str, Any]]
) -> Catalog:
    """The catalog of the tenant whose segments these are (made with their geometry; the
    node sets its quotas when it learns the tenant). A quarantined scope has none: it only
    holds space, in the default tenant's book."""
    if not records:
        return default
    first = records[0]
    return tenancy.ensure(first["tenant"], first["layers"], first["page_bytes"])


def segment_from_record(catalog: Catalog, record: dict[str, Any]) -> Segment:
    layout = catalog.layout_for(record["pages"])
    digests = np.frombuffer(record["digests"], dtype=DIGEST_DTYPE).copy()
    checksums = np.frombuffer(record["checksums"], dtype=np.uint64).copy()
    checksums = checksums.reshape(layout.layers, layout.blocks)
    segment = Segment(
        record["segment"], record["scope"], Medium.SSD, record["offset"], layout, digests, checksums
    )
    segment.sealed = record.get("sealed", False)
    return segment
