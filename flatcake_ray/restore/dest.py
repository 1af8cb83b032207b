"""Where a restore's pages go: the destinations of the restore pipeline.

The pipeline streams a layer of a leased prefix as staged pages in request order; a
:class:`Destination` knows where request position ``i`` of layer ``l`` lives in the engine's
KV memory and copies staged pages there. Two kinds:

- :class:`PagedPool`: one pool tensor, ``layer_first`` ``[layers, slots, *page]`` or
  ``page_first`` ``[slots, layers, *page]``; position ``i`` goes to slot ``slot_ids[i]``.
- :class:`LayerTensors`: one tensor per layer, ``[blocks, *page]`` in logical (block first)
  order, as vLLM registers its KV caches; position ``i`` of layer ``l`` goes to block
  ``block_ids[i]`` of ``tensors[l]``. A page is the bytes of ``tensors[l][block]`` in logical
  row-major order, which is what vLLM's connector saves (``tensor[blocks].reshape(n, -1)``),
  so a page saved under one physical layout restores under another. A page is written as
  its contiguous pieces, in that logical order: one piece where the block's bytes are
  contiguous, several where it is split in memory (the K and V halves of a K/V-first
  physical layout seen block first). On the host each piece is one native copy row; on a
  GPU a one-piece block goes through the pipeline's scatter kernel and a split one through
  :func:`scatter_pages`. Where a tensor's pieces lie is found once per shape and strides
  (an engine restores into the same tensors every time), and checked then: no piece of one
  block overlaps one of another, so the pieces of distinct blocks in range are written with
  no check per restore (a restore's destination and its scatters, 60 pages x 3 layers into
  scattered blocks: 0.42-0.47 -> 0.14 ms, ``benchmarks/host_layer_scatter.py``). A scatter a
  caller wrapped (tests watch and hold layers) is called for every one-piece layer.

Constructors check everything that can be checked before any byte moves, and raise
:class:`~flatcake_ray.errors.ShapeError`.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from flatcake_ray.cuda_ext.host_copy import copy_rows_to
from flatcake_ray.cuda_ext.scatter import (
    LAYER_FIRST,
    Layout,
    scatter_layer,
    scatter_layer_reference,
    scatter_pages,
)
from flatcake_ray.errors import ShapeError

__all__ = ["Destination", "HostPieces", "LayerTensors", "PagedPool", "as_destination"]

ScatterFn = Callable[..., None]  # cuda_ext.scatter.scatter_layer's signature


class Destination(ABC):
    """Maps (layer, request positions) to engine memory; see the module docstring."""

    device: torch.device
    layers: int
    page_bytes: int
    pages: int  # request positions mapped: one per key of the restore

    @abstractmethod
    def scatter(
        self,
        staged: torch.Tensor,
        positions: np.ndarray,
        layer: int,
        scatter: ScatterFn,
        stream: Any = None,
    ) -> None:
        """Copy ``staged`` (contiguous, ``len(positions)`` pages of ``layer`` back to back) to
        where ``positions`` go, through ``scatter`` where the layout allows; ``stream`` is
        the CUDA stream to run on (None on the CPU)."""

    def host_pages(self, layer: int, positions: np.ndarray) -> np.ndarray | None:
        """The bytes where ``positions`` of ``layer`` go, as one writable uint8 array, when
        they lie back to back in host memory (the restore then copies pages straight there
        and checks them in place); None otherwise, or on a device."""
        return None

    def host_pieces(self, layer: int, positions: np.ndarray) -> HostPieces | None:
        """Where the pages of ``positions`` of ``layer`` go in host memory, piece by piece in
        each page's logical order, page after page (a checked restore copies each checksum
        block of pages straight into its pieces and hashes it in the same pass); None on a
        device. The addresses lie in the destination's own memory, every piece inside it and
        no two overlapping (checked when the destination was made)."""
        return None


class HostPieces(NamedTuple):
    addresses: np.ndarray  # int64, ``pieces_per_page`` a page, pages in ``positions`` order
    piece_bytes: int


class PagedPool(Destination):
    """One paged pool tensor (or writable numpy array) in ``layer_first`` or ``page_first``."""

    def __init__(
        self,
        pool: torch.Tensor | np.ndarray,
        slot_ids: Sequence[int] | np.ndarray | torch.Tensor,
        layout: Layout = LAYER_FIRST,
    ) -> None:
        self.pool = _as_pool(pool, layout)
        self.layout = layout
        layer_dim, slot_dim = (0, 1) if layout == LAYER_FIRST else (1, 0)
        self.slot_ids = check_ids(slot_ids, self.pool.shape[slot_dim], "slot")
        self.device = self.pool.device
        self.layers = self.pool.shape[layer_dim]
        self.page_bytes = math.prod(self.pool.shape[2:]) * self.pool.element_size()
        self.pages = len(self.slot_ids)

    def scatter(self, staged, positions, layer, scatter, stream=None) -> None:
        ids = torch.from_numpy(self.slot_ids[positions])
        scatter(staged, self.pool, ids, layer, self.layout, stream=stream, check_slots=False)

    def host_pages(self, layer: int, positions: np.ndarray) -> np.ndarray | None:
        if self.layout != LAYER_FIRST:
            return None
        return _consecutive_pages(self.pool[layer], self.slot_ids[positions])

    def host_pieces(self, layer: int, positions: np.ndarray) -> HostPieces | None:
        pool = self.pool
        if pool.device.type != "cpu" or not pool[0, 0].is_contiguous():
            return None
        layer_dim, slot_dim = (0, 1) if self.layout == LAYER_FIRST else (1, 0)
        size = pool.element_size()
        base = pool.data_ptr() + layer * pool.stride(layer_dim) * size
        slots = self.slot_ids[positions]
        return HostPieces(base + slots * (pool.stride(slot_dim) * size), self.page_bytes)


class LayerTensors(Destination):
    """One ``[blocks, *page]`` tensor per layer (vLLM's KV caches); see the module docstring.

    Every tensor's last dimension must be contiguous (vLLM's always is): pieces are found in
    its byte view.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        block_ids: Sequence[int] | np.ndarray | torch.Tensor,
    ) -> None:
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ShapeError("LayerTensors needs one torch.Tensor per layer")
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            names = sorted(map(str, devices))
            raise ShapeError(f"the layer tensors are on several devices: {names}")
        self._layers = [_LayerMap(tensor, layer) for layer, tensor in enumerate(tensors)]
        sizes = {m.page_bytes for m in self._layers}
        if len(sizes) != 1:
            raise ShapeError(f"the layer tensors differ in page bytes: {sorted(sizes)}")
        blocks = min(m.blocks for m in self._layers)
        self.block_ids = check_ids(block_ids, blocks, "block")
        self.device = devices.pop()
        self.layers = len(self._layers)
        self.page_bytes = sizes.pop()
        self.pages = len(self.block_ids)

    def scatter(self, staged, positions, layer, scatter, stream=None) -> None:
        self._layers[layer].scatter(staged, self.block_ids[positions], scatter, stream)

    def host_pages(self, layer: int, positions: np.ndarray) -> np.ndarray | None:
        pool = self._layers[layer].pool  # None: its blocks are split in memory
        return None if pool is None else _consecutive_pages(pool[0], self.block_ids[positions])

    def host_pieces(self, layer: int, positions: np.ndarray) -> HostPieces | None:
        return self._layers[layer].host_pieces(self.block_ids[positions])


class _LayerMap:
    """How one layer tensor's blocks lie in memory: one contiguous piece or several."""

    def __init__(self, tensor: torch.Tensor, layer: int) -> None:
        if tensor.dim() < 2:
            raise ShapeError(f"layer {layer}: a KV tensor is [blocks, *page], got {tensor.shape}")
        if tensor.dtype != torch.uint8 and tensor.stride(-1) != 1:
            raise ShapeError(f"layer {layer}: the last axis must be contiguous ({tensor.stride()})")
        data = tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)
        self.blocks = data.shape[0]
        self.page_bytes = math.prod(data.shape[1:])
        self.block_stride = data.stride(0)  # bytes: data is a uint8 view
        try:
            self.geometry = _geometry(tuple(data.shape), tuple(data.stride()))
        except ShapeError as exc:
            raise ShapeError(f"layer {layer}: {exc}") from exc
        self.span = data.as_strided((self.geometry.span,), (1,))  # every byte it covers
        # One piece a block: also a one-layer pool, for the scatter kernel (a device) and
        # for copies straight into consecutive blocks (``host_pages``).
        self.pool = data.unsqueeze(0) if self.geometry.one_piece else None

    def _piece_offsets(self, blocks: np.ndarray) -> np.ndarray:
        """Where each piece of ``blocks`` lies in the span, block after block."""
        return (blocks[:, None] * self.block_stride + self.geometry.piece_offsets[None, :]).ravel()

    def host_pieces(self, blocks: np.ndarray) -> HostPieces | None:
        if self.span.device.type != "cpu":
            return None
        return HostPieces(
            self.span.data_ptr() + self._piece_offsets(blocks), self.geometry.piece_bytes
        )

    def scatter(self, staged: torch.Tensor, blocks: np.ndarray, scatter, stream) -> None:
        geometry = self.geometry
        offsets = self._piece_offsets(blocks)
        own = scatter is scatter_layer  # a scatter a caller wrapped (tests) sees every page
        if (own or self.pool is None) and _copy_pieces(
            staged, self.span, offsets, geometry.piece_bytes
        ):
            return
        if self.pool is not None:
            ids = torch.from_numpy(blocks)
            scatter(staged, self.pool, ids, 0, LAYER_FIRST, stream=stream, check_slots=False)
        else:
            pieces = torch.from_numpy(offsets)
            scatter_pages(staged, self.span, pieces, geometry.piece_bytes, stream=stream)


@dataclass(frozen=True)
class _Geometry:
    """Where the pieces of a block lie, for a ``[blocks, *page]`` uint8 view of one shape and
    strides: ``piece_offsets`` (bytes from the block's first, in logical order; ``[0]`` where
    a block is one piece), ``piece_bytes`` each, ``span`` bytes covered by the whole view."""

    piece_offsets: np.ndarray
    piece_bytes: int
    span: int

    @property
    def one_piece(self) -> bool:
        return len(self.piece_offsets) == 1


@functools.lru_cache(maxsize=512)
def _geometry(shape: tuple[int, ...], stride: tuple[int, ...]) -> _Geometry:
    """Found once per shape and strides (an engine restores into the same tensors every
    time), and checked then: no piece of one block overlaps a piece of another, so the
    pieces of distinct blocks in range (``check_ids``) can be written with no check per
    restore."""
    piece_dims, piece_bytes = _split_contiguous(shape, stride)
    extent = sum((n - 1) * step for n, step in zip(shape, stride, strict=True)) + 1
    span = 0 if 0 in shape else extent  # an empty view covers no byte
    offsets = np.zeros(1, dtype=np.int64)  # one piece a block
    if piece_dims:
        grid = np.indices([shape[d] for d in piece_dims]).reshape(len(piece_dims), -1)
        steps = np.array([stride[d] for d in piece_dims], dtype=np.int64)
        offsets = (grid.T @ steps).astype(np.int64)  # logical (row-major) order
    every = np.sort((np.arange(shape[0])[:, None] * stride[0] + offsets[None, :]).ravel())
    if len(every) > 1 and int(np.diff(every).min()) < piece_bytes:
        raise ShapeError(f"the tensor's blocks overlap in memory (strides {stride})")
    offsets.setflags(write=False)
    return _Geometry(offsets, piece_bytes, span)


def _copy_pieces(
    staged: torch.Tensor, span: torch.Tensor, offsets: np.ndarray, piece_bytes: int
) -> bool:
    """Piece ``i`` of ``staged`` (host pages back to back) to byte ``offsets[i]`` of
    ``span``, one native copy row each; False, with nothing copied, on a device or where
    the native pass is not built. The offsets are the caller's proof (checked blocks, a
    checked geometry): a host scatter of arbitrary offsets goes through ``scatter_pages``."""
    if span.device.type != "cpu" or staged.device.type != "cpu" or not staged.is_contiguous():
        return False
    if staged.numel() * staged.element_size() != len(offsets) * piece_bytes:
        return False
    return copy_rows_to(span.data_ptr(), offsets, staged.data_ptr(), piece_bytes)


def _consecutive_pages(slots_first: torch.Tensor, slots: np.ndarray) -> np.ndarray | None:
    """``slots_first[slots]`` (``[slots, *page]``) as one uint8 host array, when the slots
    are consecutive and their bytes contiguous; else None."""
    if slots_first.device.type != "cpu" or not len(slots):
        return None
    first = int(slots[0])
    if int(slots[-1]) - first != len(slots) - 1 or np.any(np.diff(slots) != 1):
        return None
    block = slots_first[first : first + len(slots)]
    if not block.is_contiguous():
        return None
    return block.reshape(-1).view(torch.uint8).numpy()


def _split_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[list[int], int]:
    """(page dims outside the trailing contiguous run, bytes of that run) of a uint8 view."""
    run, dim = 1, len(shape) - 1
    while dim >= 1 and (shape[dim] == 1 or stride[dim] == run):
        run *= shape[dim]
        dim -= 1
    return [d for d in range(1, dim + 1) if shape[d] != 1], run


def as_destination(dest: Any, slot_ids: Any, layout: Layout) -> Destination:
    """``submit``'s two forms: a :class:`Destination`, or a pool with its slot ids."""
    if isinstance(dest, Destination):
        if slot_ids is not None:
            raise ShapeError("slot ids come with a pool; a Destination carries its own")
        return dest
    if slot_ids is None:
        raise ShapeError("a pool needs slot ids (one per key)")
    return PagedPool(dest, slot_ids, layout)


def _as_pool(pool: torch.Tensor | np.ndarray, layout: Layout) -> torch.Tensor:
    if isinstance(pool, np.ndarray):
        if not pool.flags.writeable:
            raise ShapeError("the pool is a read-only array")
        pool = torch.from_numpy(pool)
    if not isinstance(pool, torch.Tensor):
        raise ShapeError(f"the pool must be a tensor or an array, not {type(pool).__name__}")
    empty = torch.empty(0, dtype=torch.uint8, device=pool.device)
    scatter_layer_reference(empty, pool, empty.long(), 0, layout)  # checks layout, strides
    return pool


def check_ids(ids: Any, limit: int, what: str) -> np.ndarray:
    """Distinct integer ids in ``[0, limit)`` as int64 numpy (1-D)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    array = np.asarray(ids)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise ShapeError(f"{what} ids must be 1-D integers, got {array.shape} of {array.dtype}")
    array = array.astype(np.int64)
    if array.size and (array.min() < 0 or array.max() >= limit):
        raise ShapeError(f"{what} ids must be in [0, {limit}); got {array.min()}..{array.max()}")
    ascending = array.size < 2 or bool(np.all(array[1:] > array[:-1]))  # the usual case: fast
    if not ascending and np.unique(array).size != array.size:
        raise ShapeError(f"{what} ids must be distinct")
    return array
