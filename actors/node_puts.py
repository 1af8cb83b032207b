"""The owner's side of the Ray client's puts: where a put's bytes go, and landing them.

``begin`` plans the put (the store's one put path, ``PutHandle``) and answers with a
:class:`~flatcake_ray.actors.protocol.PutTarget`: a DRAM put's extents in the arena, written
in place by the client (mapped on this node, NIXL WRITE from another; no copy by the owner);
an SSD put's two landing slots (``actors/landing.py``), each layer written from its slot to
the drive by ``land``; or, when the landing area is full, ``inline`` (LAST RESORT: the bytes
ride in ``land`` calls). ``commit`` lands the DRAM layers written in place (their checksums),
then publishes: keys become visible only after the last layer is in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from flatcake_ray.actors.landing import LandingArea
from flatcake_ray.actors.protocol import PutMemory, PutTarget, PutTicket
from flatcake_ray.core.api import PutResult
from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import ShapeError, StoreWriteError
from flatcake_ray.media.arena import ArenaChunk
from flatcake_ray.node.put import PutHandle
from flatcake_ray.node.store import FlatCakeStore

SLOTS = 2  # landing slots per SSD put: the client fills one while the node writes the other
# An SSD put of at most this share of the landing area gets a slot per layer: written in
# place, landed at commit, no calls per layer.
WHOLE_SHARE = 8


class NodePuts:
    def __init__(
        self,
        store: FlatCakeStore,
        landing: LandingArea,
        counters: dict[str, int],
        owner: tuple[int, float],
    ) -> None:
        """``owner``: (process id, start time) of this node, on every ticket."""
        self.store = store
        self.landing = landing
        self.counters = counters
        self.owner = owner
        # The NIXL peer of one arena chunk (NodeExports.arena_peer), set once exported.
        self.arena_peer: Callable[[list[ArenaChunk]], Any] = lambda chunks: None

    def begin(self, tenant: str, keys: Any, options: dict[str, Any]) -> PutTicket:
        handle = self.store.begin_put(keys, tenant=tenant, **options)
        try:
            target = self._target(handle, tenant)
            handle.route = target.memory.value  # the put's metrics say where its bytes went
        except BaseException:
            handle.abort()
            raise
        self.counters["puts_layerwise"] += 1
        self.counters[f"puts_{target.memory.value}"] += 1
        return PutTicket(handle.put_id, handle.pages_new, target)

    def _target(self, handle: PutHandle, tenant: str) -> PutTarget:
        positions = handle.new_positions
        if handle.medium is None:
            return PutTarget(PutMemory.NONE, (), 0, positions)
        if handle.medium is Medium.DRAM:
            offsets = handle.arena_offsets()
            # A segment lies in one chunk: the caller's tenant's (core/extents.py).
            chunk = self.store.arena.chunk(offsets[0] // self.store.arena.chunk_bytes)
            peer = self.arena_peer([chunk])
            return self._in_chunk(PutMemory.ARENA, offsets, handle, chunk, peer)
        taken = self._take_slots(handle, tenant)
        if taken is None:
            return PutTarget(PutMemory.INLINE, (), handle.layer_bytes, positions)
        slots, (region_id, start) = taken
        handle.on_done = lambda: self.landing.give(region_id, tenant)
        offsets = tuple(start + slot * handle.layer_stride for slot in range(slots))
        handle.slots = offsets
        chunk = self.landing.chunk_at(start)  # the slots' chunk, this tenant's
        peer = self.landing.peer_of(chunk)
        return self._in_chunk(PutMemory.LANDING, offsets, handle, chunk, peer)

    def _take_slots(self, handle: PutHandle, tenant: str) -> tuple[int, tuple[int, int]] | None:
        """(slots, region) of landing space: a slot per layer for a small put, else two, else
        one (the client then waits for each layer to land before writing the next)."""
        layers, stride = handle.layers, handle.layer_stride
        whole = layers * stride * WHOLE_SHARE <= self.landing.nbytes
        for slots in sorted({layers if whole else 1, min(SLOTS, layers), 1}, reverse=True):
            taken = self.landing.take(slots * stride, tenant)
            if taken is not None:
                return slots, taken
        return None

    def land(
        self, tenant: str, put_id: object, layer: object, inline: Any, sums: Any = None
    ) -> None:
        """Layer ``layer`` is in its slot (or ``inline``): write it out. ``sums``: the
        checksums of what the client wrote into the slot. A failure aborts."""
        handle = self.store.puts.get(put_id, tenant)
        number = _layer(layer)
        try:
            written = _sums(sums)
            handle.land_layer(number, self._source(handle, number, inline), written)
        except BaseException:
            handle.abort()
            self.counters["puts_aborted"] += 1
            raise

    def _source(self, handle: PutHandle, layer: int, inline: Any) -> np.ndarray | None:
        if inline is not None:
            data = np.asarray(inline)
            if data.dtype != np.uint8 or data.ndim != 1:
                raise ShapeError(f"inline layer bytes must be 1-D uint8, got {data.dtype}")
            return data
        if not handle.slots:
            return None  # a DRAM put, written in place
        slot = handle.slots[layer % len(handle.slots)]
        return self.landing.view(slot, handle.layer_stride)

    def commit(self, tenant: str, put_id: object, in_place: Any, sums: Any = None) -> PutResult:
        """Land the layers ``in_place`` (written into the arena or their own landing slots,
        with no ``land`` call; ``sums``, one entry per layer there: the checksums of what the
        client wrote), then publish."""
        handle = self.store.puts.get(put_id, tenant)
        try:
            layers = _layers(in_place)
            written = _layer_sums(sums, len(layers))
            for layer, layer_sums in zip(layers, written, strict=True):
                handle.land_layer(layer, self._source(handle, layer, None), layer_sums)
            result = handle.commit()
        except BaseException:
            handle.abort()
            self.counters["puts_aborted"] += 1
            raise
        self.counters["puts"] += 1
        return result

    def _in_chunk(
        self,
        memory: PutMemory,
        offsets: tuple[int, ...],
        handle: PutHandle,
        chunk: ArenaChunk,
        peer: Any,
    ) -> PutTarget:
        """A target in one chunk of the node's memory (the only chunk its ticket names)."""
        return PutTarget(
            memory,
            offsets,
            handle.layer_bytes,
            handle.new_positions,
            nbytes=chunk.nbytes,
            peer=peer,
            chunk_offset=chunk.offset,
            check_pages=handle.check_pages,
            owner=self.owner,
        )

    def abort(self, tenant: str, put_id: object) -> None:
        try:
            handle = self.store.puts.get(put_id, tenant)
        except StoreWriteError:  # ended already (or never this tenant's): said, and counted
            self.counters["aborts_refused"] += 1
            raise
        handle.abort()
        self.counters["puts_aborted"] += 1

    def close(self) -> None:
        self.landing.close()


def _layer(layer: object) -> int:
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise ShapeError(f"a layer is an int, got {type(layer).__name__}")
    return layer


def _layers(in_place: Any) -> list[int]:
    if not isinstance(in_place, (list, tuple)) or len(in_place) > 1 << 16:
        raise ShapeError("in_place must be a list of layer numbers")
    return [_layer(layer) for layer in in_place]


def _sums(sums: Any) -> np.ndarray | None:
    """A writer's checksums of one layer: None, or a 1-D uint64 array (its length is checked
    against the segment's blocks when the layer lands)."""
    if sums is None:
        return None
    if not isinstance(sums, np.ndarray) or sums.dtype != np.uint64 or sums.ndim != 1:
        raise ShapeError("a layer's checksums are a 1-D uint64 array")
    return sums


def _layer_sums(sums: Any, layers: int) -> list[np.ndarray | None]:
    """One writer's checksums per in-place layer (``sums`` None or empty: none sent)."""
    if sums is None or (isinstance(sums, (list, tuple)) and not sums):
        return [None] * layers
    if not isinstance(sums, (list, tuple)) or len(sums) != layers:
        raise ShapeError("sums must be a list with one entry per in_place layer")
    return [_sums(entry) for entry in sums]
