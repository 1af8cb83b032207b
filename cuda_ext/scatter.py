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
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from flatcake_ray.core.runs import run_bounds
from flatcake_ray.cuda_ext import _library
from flatcake_ray.cuda_ext._library import ScatterKernelError, ScatterLibrary, ScatterLibraryError
from flatcake_ray.cuda_ext._validate import (
    BIT_VIEWS,
    as_index_tensor,
    check_byte_offsets,
    check_devices,
    check_slot_ids,
    check_staging,
    contiguous_page_elems,
    require_bit_view,
    require_tensor,
)
from flatcake_ray.cuda_ext.host_copy import copy_many
from flatcake_ray.errors import ShapeError

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

log = logging.getLogger(__name__)

Layout = Literal["layer_first", "page_first"]
Backend = Literal["auto", "kernel", "torch"]
LAYER_FIRST: Layout = "layer_first"
PAGE_FIRST: Layout = "page_first"
LAYOUTS: tuple[Layout, ...] = (LAYER_FIRST, PAGE_FIRST)
BACKENDS: tuple[Backend, ...] = ("auto", "kernel", "torch")


_fallback_logged = False
SCATTERED_RUNS = 64  # more runs than this, averaging under 4 pages: one fancy-indexed copy


@dataclass(frozen=True)
class _Target:
    """Where pages go: ``view.data_ptr() + index * index_stride_bytes`` for the kernel."""

    view: torch.Tensor  # the torch path index_copy_s into dim 0 of this view
    index_stride_bytes: int
    index_limit: int
    page_bytes: int


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
    target = _layer_target(pool, layer, layout)
    ids = as_index_tensor(slot_ids, "slot_ids")
    check_staging(staging, pool, ids.numel(), target.page_bytes)
    check_devices(staging, pool, ids, stream)
    validate = None
    if check_slots or ids.device.type == "cpu":
        validate = functools.partial(check_slot_ids, num_slots=target.index_limit)
    _dispatch(staging, ids, target, stream, backend, validate, _copy_layer_torch)


def scatter_layer_reference(
    staging: torch.Tensor,
    pool: torch.Tensor,
    slot_ids: torch.Tensor | Sequence[int],
    layer: int,
    layout: Layout,
) -> None:
    """The torch (``index_copy_``) implementation: the test oracle and the CPU path."""
    target = _layer_target(pool, layer, layout)
    ids = as_index_tensor(slot_ids, "slot_ids")
    check_staging(staging, pool, ids.numel(), target.page_bytes)
    check_devices(staging, pool, ids, None)
    check_slot_ids(ids, target.index_limit)
    _copy_layer_torch(staging, ids.to(pool.device, torch.int64), target)


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
    target = _offsets_target(dest, page_bytes)
    offsets = as_index_tensor(byte_offsets, "byte_offsets")
    check_staging(staging, dest, offsets.numel(), page_bytes)
    check_devices(staging, dest, offsets, stream)
    validate = None
    if check_offsets or offsets.device.type == "cpu":
        validate = functools.partial(
            check_byte_offsets, page_bytes=page_bytes, index_limit=target.index_limit
        )
    _dispatch(staging, offsets, target, stream, backend, validate, _copy_offsets_torch)


def scatter_pages_reference(
    staging: torch.Tensor,
    dest: torch.Tensor,
    byte_offsets: torch.Tensor | Sequence[int],
    page_bytes: int,
) -> None:
    """The torch implementation of :func:`scatter_pages`."""
    target = _offsets_target(dest, page_bytes)
    offsets = as_index_tensor(byte_offsets, "byte_offsets")
    check_staging(staging, dest, offsets.numel(), page_bytes)
    check_devices(staging, dest, offsets, None)
    check_byte_offsets(offsets, page_bytes, target.index_limit)
    _copy_offsets_torch(staging, offsets.to(dest.device, torch.int64), target)


def kernel_available() -> bool:
    """Whether the built CUDA library loads and can run here (loads it on first call)."""
    return _library.load().library is not None


# ------------------------------------------------------------------------------- targets


def _layer_target(pool: torch.Tensor, layer: int, layout: Layout) -> _Target:
    require_tensor(pool, "pool")
    if layout not in LAYOUTS:
        raise ShapeError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    if pool.dim() < 3:
        raise ShapeError(
            f"pool must be [layers, slots, *page] or [slots, layers, *page], "
            f"got shape {tuple(pool.shape)}"
        )
    layer_dim, slot_dim = (0, 1) if layout == LAYER_FIRST else (1, 0)
    num_layers = pool.shape[layer_dim]
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ShapeError(f"layer must be an int in [0, {num_layers}), not {layer!r}")
    page_elems = contiguous_page_elems(pool, first_page_dim=2)
    require_bit_view(pool)
    num_slots = pool.shape[slot_dim]
    if num_slots > 1 and pool.stride(slot_dim) < page_elems:
        raise ShapeError(
            f"pool slots overlap: slot stride {pool.stride(slot_dim)} elements "
            f"< {page_elems} elements per page"
        )
    itemsize = pool.element_size()
    return _Target(
        view=pool.select(layer_dim, layer),
        index_stride_bytes=pool.stride(slot_dim) * itemsize,
        index_limit=num_slots,
        page_bytes=page_elems * itemsize,
    )


def _offsets_target(dest: torch.Tensor, page_bytes: int) -> _Target:
    require_tensor(dest, "dest")
    if not dest.is_contiguous():
        raise ShapeError("dest must be contiguous (offsets are bytes from its first element)")
    dest_bytes = dest.numel() * dest.element_size()
    if isinstance(page_bytes, bool) or not isinstance(page_bytes, int):
        raise ShapeError(f"page_bytes must be an int, not {page_bytes!r}")
    if not 0 < page_bytes <= dest_bytes:
        raise ShapeError(f"page_bytes must be in [1, {dest_bytes}] (dest's size), not {page_bytes}")
    return _Target(
        view=dest.reshape(-1).view(torch.uint8),
        index_stride_bytes=1,
        index_limit=dest_bytes - page_bytes + 1,  # offsets at which a whole page fits
        page_bytes=page_bytes,
    )


# ----------------------------------------------------------------------------- execution


def _dispatch(
    staging: torch.Tensor,
    ids: torch.Tensor,
    target: _Target,
    stream: torch.cuda.Stream | int | None,
    backend: Backend,
    validate: Callable[[torch.Tensor], None] | None,
    torch_copy: Callable[[torch.Tensor, torch.Tensor, _Target], None],
) -> None:
    """Validates ``ids`` (if asked) and copies, on ``stream`` for CUDA tensors."""
    if backend not in BACKENDS:
        raise ShapeError(f"backend must be one of {BACKENDS}, not {backend!r}")
    device = target.view.device
    if device.type != "cuda":
        if backend == "kernel":
            raise ShapeError(f"backend='kernel' needs CUDA tensors, these are on {device}")
        if validate is not None:
            validate(ids)
        if torch_copy is _copy_layer_torch:
            _copy_layer_host(staging, ids.to(torch.int64), target)
        else:
            torch_copy(staging, ids.to(torch.int64), target)
        return
    cuda_stream = _resolve_stream(stream, device)
    library = None if backend == "torch" else _library_for(backend)
    with torch.cuda.device(device), torch.cuda.stream(cuda_stream):
        if validate is not None:
            validate(ids)  # on the caller's stream, which orders ids after their producer
        # Allocated under the stream, so the caching allocator orders its reuse after us.
        device_ids = ids.to(device=device, dtype=torch.int64).contiguous()
        if library is None:
            torch_copy(staging, device_ids, target)
        else:
            _launch(library, staging, device_ids, target, device, cuda_stream)


def _library_for(backend: Backend) -> ScatterLibrary | None:
    global _fallback_logged
    loaded = _library.load()
    if loaded.library is not None:
        return loaded.library
    if backend == "kernel":
        raise ScatterLibraryError(
            f"scatter kernel unavailable: {loaded.reason}; build it "
            "with `python -m flatcake_ray.cuda_ext.build`"
        )
    if not _fallback_logged:
        _fallback_logged = True
        log.warning("CUDA page scatter uses the torch reference on the GPU: %s", loaded.reason)
    return None


def _resolve_stream(stream, device: torch.device) -> torch.cuda.Stream:
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, bool) or not isinstance(stream, int | torch.cuda.Stream):
        raise ShapeError(
            f"stream must be a torch.cuda.Stream or a cudaStream_t int, not {type(stream).__name__}"
        )
    if isinstance(stream, int):
        return torch.cuda.ExternalStream(stream, device=device)
    if stream.device != device:
        raise ShapeError(f"stream is on {stream.device}, the tensors on {device}")
    return stream


def _launch(library: ScatterLibrary, staging, device_ids, target: _Target, device, stream) -> None:
    library.scatter_pages(
        src=staging.data_ptr(),
        dst_base=target.view.data_ptr(),
        page_index=device_ids.data_ptr(),
        num_pages=device_ids.numel(),
        page_bytes=target.page_bytes,
        index_stride_bytes=target.index_stride_bytes,
        index_limit=target.index_limit,
        device=device.index,
        stream=stream.cuda_stream,
    )


def _copy_layer_torch(staging: torch.Tensor, ids: torch.Tensor, target: _Target) -> None:
    bits = BIT_VIEWS[target.view.element_size()]
    slots = target.view.view(bits)  # [slots, *page_shape]
    pages = staging.reshape(-1).view(torch.uint8).view(bits).view(ids.numel(), *slots.shape[1:])
    slots.index_copy_(0, ids, pages)


def _copy_layer_host(staging: torch.Tensor, ids: torch.Tensor, target: _Target) -> None:
    """The CPU path: one memcpy per run of consecutive slots, spread over the copy threads.

    ``index_copy_`` walks elements and measured 40-825 MB/s here against GB/s for memcpy; a
    restore's pages usually go to runs of consecutive slots, so copy runs as slices. The
    slices are copied by numpy, not ``Tensor.copy_``: on the same bytes torch's copy ran at
    0.4-0.6 of ``np.copyto`` here (4.6 vs 7.7 GB/s, 224 MB); numpy releases the GIL, so a big
    layer is copied by several threads at once (``host_copy``). Pages that go to scattered
    slots (runs of one or two pages) are copied by one fancy-indexed assignment instead of a
    Python loop. The result is bit-identical to the reference (tests compare them).
    """
    bits = BIT_VIEWS[target.view.element_size()]
    slots = target.view.view(bits)
    pages = staging.reshape(-1).view(torch.uint8).view(bits).view(ids.numel(), *slots.shape[1:])
    slot_array, page_array = slots.numpy(), pages.numpy()  # views of the same memory
    slot_numbers = ids.numpy()
    bounds = run_bounds(slot_numbers)
    if len(bounds) > SCATTERED_RUNS and len(bounds) * 4 > len(slot_numbers):
        slot_array[slot_numbers] = page_array  # scattered: one vectorised gather-scatter
        return
    pairs = []
    for start, end in bounds:
        first = int(slot_numbers[start])
        pairs.append((slot_array[first : first + end - start], page_array[start:end]))
    copy_many(pairs)


def _copy_offsets_torch(staging: torch.Tensor, offsets: torch.Tensor, target: _Target) -> None:
    # Row k of the unfolded view is bytes [k, k + page_bytes) of dest: the rows overlap, but
    # validated offsets pick rows that do not, so every byte is written at most once.
    windows = target.view.unfold(0, target.page_bytes, 1)
    pages = staging.reshape(-1).view(torch.uint8).view(offsets.numel(), target.page_bytes)
    windows.index_copy_(0, offsets, pages)
