"""Page scatter: copy one layer's staged pages into their slots of a paged KV pool.

A restore reads all requested pages of layer ``layer`` as one contiguous extent, in request
order, into a staging buffer; page ``i`` (``page_bytes`` bytes) then goes to slot
``slot_ids[i]`` of the engine's pool:

* ``"layer_first"``: pool ``[layers, slots, *page_shape]``; page i -> ``pool[layer, slot_ids[i]]``
* ``"page_first"``:  pool ``[slots, layers, *page_shape]``; page i -> ``pool[slot_ids[i], layer]``

``page_shape`` is any shape whose elements are contiguous (``page_bytes = prod(page_shape) *
itemsize``); the layer and slot dimensions may have any strides, so a K or V half of a
``[2, layers, slots, ...]`` pool works as is, and a per-layer ``[slots, ...]`` tensor works as
``tensor.unsqueeze(0)`` with ``layer=0``. :func:`scatter_pages` is the generic form (a base
tensor plus one byte offset per page) for caches of other shapes, e.g. vLLM's.

``staging`` is contiguous, ``uint8`` or the pool's dtype, exactly ``len(slot_ids) * page_bytes``
bytes (slice a larger staging window to this layer's extent). On CUDA tensors the nvcc-built
kernel runs on ``stream`` (default: the current stream), asynchronously; as with any torch op
on a side stream, the caller orders that stream after the producers of ``staging`` and
``slot_ids`` and keeps the tensors alive (or ``record_stream``) until it has run. Without a
built kernel, CUDA tensors use the torch reference on the same stream (logged once).

Every argument problem raises :class:`~flatcake_ray.errors.ShapeError`, before anything is
written. Slot ids must be in range and distinct (byte offsets: inside ``dest``, pages not
overlapping). Checking ids that live on a CUDA device waits for the stream, so
``check_slots=False`` skips it there (ids on the CPU are always checked); the kernel still
never writes outside the pool, but duplicate ids then race.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from flatcake_ray.cuda_ext import _library
from flatcake_ray.cuda_ext._dispatch import Backend, dispatch
from flatcake_ray.cuda_ext._library import ScatterKernelError, ScatterLibraryError
from flatcake_ray.cuda_ext._targets import (
    LAYER_COPY,
    OFFSETS_COPY,
    copy_layer_torch,
    copy_offsets_torch,
    layer_target,
    offsets_target,
)
from flatcake_ray.cuda_ext._validate import (
    as_index_tensor,
    check_byte_offsets,
    check_devices,
    check_slot_ids,
    check_staging,
)
from flatcake_ray.cuda_ext.layouts import LAYER_FIRST, LAYOUTS, PAGE_FIRST, Layout

__all__ = [
    "LAYER_FIRST",
    "LAYOUTS",
    "PAGE_FIRST",
    "Backend",
    "Layout",
    "ScatterKernelError",
    "ScatterLibraryError",
    "kernel_available",
    "scatter_layer",
    "scatter_layer_reference",
    "scatter_pages",
    "scatter_pages_reference",
]


# ---------------------------------------------------------------------------- public API


def scatter_layer(
    staging: torch.Tensor,
    pool: torch.Tensor,
    slot_ids: torch.Tensor | Sequence[int],
    layer: int,
    layout: Layout,
    *,
    stream: torch.cuda.Stream | int | None = None,
    check_slots: bool = True,
    backend: Backend = "auto",
) -> None:
    """Copies page i of ``staging`` into slot ``slot_ids[i]`` of ``layer`` of ``pool``.

    ``stream`` is a ``torch.cuda.Stream`` or a raw ``cudaStream_t`` handle (int), for CUDA
    tensors only. ``backend``: ``"auto"`` (kernel when built, else torch), ``"kernel"``
    (raise :class:`ScatterLibraryError` when not built) or ``"torch"``.
    """
    target = layer_target(pool, layer, layout)
    ids = as_index_tensor(slot_ids, "slot_ids")
    check_staging(staging, pool, ids.numel(), target.page_bytes)
    check_devices(staging, pool, ids, stream)
    validate = None
    if check_slots or ids.device.type == "cpu":
        validate = functools.partial(check_slot_ids, num_slots=target.index_limit)
    dispatch(staging, ids, target, stream, backend, validate, LAYER_COPY)


def scatter_layer_reference(
    staging: torch.Tensor,
    pool: torch.Tensor,
    slot_ids: torch.Tensor | Sequence[int],
    layer: int,
    layout: Layout,
) -> None:
    """The torch (``index_copy_``) implementation: the test oracle and the CPU path."""
    target = layer_target(pool, layer, layout)
    ids = as_index_tensor(slot_ids, "slot_ids")
    check_staging(staging, pool, ids.numel(), target.page_bytes)
    check_devices(staging, pool, ids, None)
    check_slot_ids(ids, target.index_limit)
    copy_layer_torch(staging, ids.to(pool.device, torch.int64), target)


def scatter_pages(
    staging: torch.Tensor,
    dest: torch.Tensor,
    byte_offsets: torch.Tensor | Sequence[int],
    page_bytes: int,
    *,
    stream: torch.cuda.Stream | int | None = None,
    check_offsets: bool = True,
    backend: Backend = "auto",
) -> None:
    """Copies page i of ``staging`` to bytes ``[byte_offsets[i], +page_bytes)`` of ``dest``.

    ``dest`` is contiguous; offsets are int32/int64 and, when checked, must keep every page
    inside ``dest`` and not overlap another. Other arguments as :func:`scatter_layer`.
    """
    target = offsets_target(dest, page_bytes)
    offsets = as_index_tensor(byte_offsets, "byte_offsets")
    check_staging(staging, dest, offsets.numel(), page_bytes)
    check_devices(staging, dest, offsets, stream)
    validate = None
    if check_offsets or offsets.device.type == "cpu":
        validate = functools.partial(
            check_byte_offsets, page_bytes=page_bytes, index_limit=target.index_limit
        )
    dispatch(staging, offsets, target, stream, backend, validate, OFFSETS_COPY)


def scatter_pages_reference(
    staging: torch.Tensor,
    dest: torch.Tensor,
    byte_offsets: torch.Tensor | Sequence[int],
    page_bytes: int,
) -> None:
    """The torch implementation of :func:`scatter_pages`."""
    target = offsets_target(dest, page_bytes)
    offsets = as_index_tensor(byte_offsets, "byte_offsets")
    check_staging(staging, dest, offsets.numel(), page_bytes)
    check_devices(staging, dest, offsets, None)
    check_byte_offsets(offsets, page_bytes, target.index_limit)
    copy_offsets_torch(staging, offsets.to(dest.device, torch.int64), target)


def kernel_available() -> bool:
    """Whether the built CUDA library loads and can run here (loads it on first call)."""
    return _library.load().library is not None
