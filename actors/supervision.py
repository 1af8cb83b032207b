"""What a storage node knows about its own restarts: how many, and what its last one lost.

Ray restarts a storage node's actor when its process dies (``max_restarts``, set by
``client/deploy.py``); the new process runs the actor's constructor again on the same root.
Its SSD scopes come back from the pool's manifest (``node/store.py``); its DRAM scopes do
not (the arena belonged to the dead process). The node writes a small record into its root
with every capacity report (its DRAM scopes, pages and bytes then), so the next start can
report what was lost: the figures of the last report before the death (writes after that
report are lost too, uncounted).

The record also counts restarts: a start that Ray made because the actor died (Ray's
``was_current_actor_reconstructed``) adds one; a start by an operator (``flatcake-ray
start`` after ``stop``) begins again at zero.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import ServiceError

if TYPE_CHECKING:
    from flatcake_ray.node.store import FlatCakeStore

RECORD_NAME = "supervision.json"


@dataclass(frozen=True)
class DramHeld:
    """A node's DRAM scopes at one report."""

    scopes: int = 0
    pages: int = 0
    bytes: int = 0

    @classmethod
    def of(cls, store: FlatCakeStore) -> DramHeld:
        scopes = pages = used = 0
        with store._lock:  # one moment's view of every tenant's scopes
            for catalog in store.tenancy:
                used += catalog.used[Medium.DRAM]
                for scope in catalog.scopes.values():
                    if scope.medium is Medium.DRAM:
                        scopes += 1
                        pages += sum(len(catalog.segments[s].digests) for s in scope.segments)
        return cls(scopes, pages, used)


class Supervision:
    """This start's restart count and the DRAM its predecessor lost; keeps the record."""

    def __init__(self, root: Path, reconstructed: bool) -> None:
        self._path = root / RECORD_NAME
        before = self._read()
        self.restarts = int(before.get("restarts", 0)) + 1 if reconstructed else 0
        self.lost = DramHeld(**before.get("dram", {})) if before else DramHeld()
        self._noted: DramHeld | None = None
        self.note(DramHeld())  # the arena starts empty: nothing to lose yet

    def _read(self) -> dict[str, Any]:
        try:
            text = self._path.read_text()
        except FileNotFoundError:
            return {}
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ServiceError(f"{self._path} is not a supervision record: {exc}") from exc
        if not isinstance(record, dict):
            raise ServiceError(f"{self._path} is not a supervision record")
        return record

    def note(self, held: DramHeld) -> None:
        """Record what a death now would lose (written whole, then renamed into place)."""
        if held == self._noted:  # an idle node writes nothing
            return
        self._noted = held
        record = {"restarts": self.restarts, "dram": asdict(held)}
        partial = self._path.with_suffix(".tmp")
        partial.write_text(json.dumps(record))
        os.replace(partial, self._path)

    def stats(self) -> dict[str, int]:
        return {
            "restarts": self.restarts,
            "lost_dram_scopes": self.lost.scopes,
            "lost_dram_pages": self.lost.pages,
            "lost_dram_bytes": self.lost.bytes,
        }
