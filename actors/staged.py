"""Where a storage node reads the bytes of a staged put from.

A client stages a put's pieces in its staging memory and names them in the call
(:class:`~flatcake_ray.actors.protocol.StagedPages`): shared memory on this node, mapped here
read-only (mappings cached by the staging segment's token); the same memory exported over
NIXL, pulled into one of this node's reusable buffers with one READ; or, as the labelled last
resort, the bytes in the call itself. :meth:`StagedReader.write` hands each piece to the put
handle it belongs to.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from flatcake_ray.actors.protocol import StagedPages, StagingKind
from flatcake_ray.actors.shipping import PullArea
from flatcake_ray.errors import ServiceError, ShapeError
from flatcake_ray.media.arena import map_shared_readonly
from flatcake_ray.node.put import PutHandle

MAX_SHM_MAPPINGS = 16


class StagedReader:
    def __init__(self, pull: PullArea | None, nixl_reason: str | None) -> None:
        self._pull = pull
        self._nixl_reason = nixl_reason
        self._shm: OrderedDict[str, tuple[Any, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def write(self, handle: PutHandle, staged: StagedPages, counters: dict[str, int]) -> None:
        """Write every staged piece into ``handle`` (counted in ``counters``)."""
        page_bytes = staged.page_bytes
        flat, slot = self._bytes(staged)
        try:
            for piece in staged.pieces:
                at = piece.offset - staged.offset
                if at < 0 or at + piece.count * page_bytes > len(flat):
                    raise ShapeError(f"a staged piece lies outside its {staged.nbytes} bytes")
                pages = flat[at : at + piece.count * page_bytes].reshape(piece.count, page_bytes)
                handle.write_pages(piece.layer, piece.first, pages)
        finally:
            if slot is not None and self._pull is not None:
                self._pull.done(slot)
        counters["put_pieces"] += len(staged.pieces)
        counters[f"puts_{staged.kind.value}"] += 1

    def _bytes(self, staged: StagedPages) -> tuple[np.ndarray, Any]:
        """The staged bytes as a flat uint8 view (and the pull slot to give back, if any)."""
        if staged.kind is StagingKind.INLINE:
            return np.asarray(staged.inline, dtype=np.uint8).reshape(-1), None
        if staged.kind is StagingKind.SHM:
            return self._shm_view(staged), None
        if self._pull is None:
            raise ServiceError(f"this node cannot pull over NIXL: {self._nixl_reason}")
        slot, flat = self._pull.pull(staged.peer, staged.offset, staged.nbytes)
        return flat, slot

    def _shm_view(self, staged: StagedPages) -> np.ndarray:
        with self._lock:
            known = self._shm.get(staged.token)
            if known is None:
                known = map_shared_readonly(staged.path, staged.buffer_bytes)
                self._shm[staged.token] = known
            self._shm.move_to_end(staged.token)
            while len(self._shm) > MAX_SHM_MAPPINGS:
                self._shm.popitem(last=False)  # unmapped once the last view goes
        return known[1][staged.offset : staged.offset + staged.nbytes]

    def close(self) -> None:
        if self._pull is not None:
            self._pull.close()
            self._pull = None
        with self._lock:
            self._shm.clear()
