"""Where a scatter's pages go, and the torch and host copies that put them there.

A :class:`Target` is the destination of one scatter as the kernel sees it (a base, a stride
per index, how many indices are valid, the page size): :func:`layer_target` makes one for a
layer of a paged KV pool in either layout, :func:`offsets_target` for byte offsets into a
contiguous tensor. The copies are the torch reference (``index_copy_``) and the CPU path
(one memcpy per run of consecutive slots); :mod:`~flatcake_ray.cuda_ext.scatter` checks the
arguments and picks the kernel or one of these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from flatcake_ray.core.runs import run_bounds
from flatcake_ray.cuda_ext._validate import (
    BIT_VIEWS,
    contiguous_page_elems,
    require_bit_view,
    require_tensor,
)
from flatcake_ray.cuda_ext.host_copy import copy_many, copy_rows_to
from flatcake_ray.cuda_ext.layouts import LAYER_FIRST, LAYOUTS, Layout
from flatcake_ray.errors import ShapeError

SCATTERED_RUNS = 64  # more runs than this, averaging under 4 pages: one fancy-indexed copy


@dataclass(frozen=True)
class Target:
    """Where pages go: ``view.data_ptr() + index * index_stride_bytes`` for the kernel."""

    view: torch.Tensor  # the torch path index_copy_s into dim 0 of this view
    index_stride_bytes: int
    index_limit: int
    page_bytes: int


def layer_target(pool: torch.Tensor, layer: int, layout: Layout) -> Target:
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
    return Target(
        view=pool.select(layer_dim, layer),
        index_stride_bytes=pool.stride(slot_dim) * itemsize,
        index_limit=num_slots,
        page_bytes=page_elems * itemsize,
    )


def offsets_target(dest: torch.Tensor, page_bytes: int) -> Target:
    require_tensor(dest, "dest")
    if not dest.is_contiguous():
        raise ShapeError("dest must be contiguous (offsets are bytes from its first element)")
    dest_bytes = dest.numel() * dest.element_size()
    if isinstance(page_bytes, bool) or not isinstance(page_bytes, int):
        raise ShapeError(f"page_bytes must be an int, not {page_bytes!r}")
    if not 0 < page_bytes <= dest_bytes:
        raise ShapeError(f"page_bytes must be in [1, {dest_bytes}] (dest's size), not {page_bytes}")
    return Target(
        view=dest.reshape(-1).view(torch.uint8),
        index_stride_bytes=1,
        index_limit=dest_bytes - page_bytes + 1,  # offsets at which a whole page fits
        page_bytes=page_bytes,
    )


# ----------------------------------------------------------------------------- copies


def copy_layer_torch(staging: torch.Tensor, ids: torch.Tensor, target: Target) -> None:
    bits = BIT_VIEWS[target.view.element_size()]
    slots = target.view.view(bits)  # [slots, *page_shape]
    pages = staging.reshape(-1).view(torch.uint8).view(bits).view(ids.numel(), *slots.shape[1:])
    slots.index_copy_(0, ids, pages)


def copy_layer_host(staging: torch.Tensor, ids: torch.Tensor, target: Target) -> None:
    """The CPU path: one native copy row per page (``cuda_ext/_copyhash``: its idle threads
    share a big layer); where that is not built, one memcpy per run of consecutive slots.

    ``index_copy_`` walks elements and measured 40-825 MB/s here against GB/s for memcpy.
    Without the native pass, runs of consecutive slots are copied as slices by numpy, not
    ``Tensor.copy_`` (on the same bytes torch's copy ran at 0.4-0.6 of ``np.copyto`` here:
    4.6 vs 7.7 GB/s, 224 MB; numpy releases the GIL, so a big layer is copied by several
    threads at once, ``host_copy``), and pages that go to scattered slots (runs of one or
    two) by one fancy-indexed assignment (a vLLM engine's blocks: 15.7 MB of 32 KiB pages
    took 4 ms that way). The result is bit-identical to the reference (tests compare them).
    """
    slot_numbers = ids.numpy()  # checked by the caller: in range, distinct
    if _copy_rows(staging, target, slot_numbers * target.index_stride_bytes):
        return
    bits = BIT_VIEWS[target.view.element_size()]
    slots = target.view.view(bits)
    pages = staging.reshape(-1).view(torch.uint8).view(bits).view(ids.numel(), *slots.shape[1:])
    slot_array, page_array = slots.numpy(), pages.numpy()  # views of the same memory
    bounds = run_bounds(slot_numbers)
    if len(bounds) > SCATTERED_RUNS and len(bounds) * 4 > len(slot_numbers):
        slot_array[slot_numbers] = page_array  # scattered: one vectorised gather-scatter
        return
    pairs = []
    for start, end in bounds:
        first = int(slot_numbers[start])
        pairs.append((slot_array[first : first + end - start], page_array[start:end]))
    copy_many(pairs)


def _copy_rows(staging: torch.Tensor, target: Target, offsets: np.ndarray) -> bool:
    """Page ``i`` of ``staging`` to byte ``offsets[i]`` of ``target``'s view, one native
    copy row each (checked: inside the view, apart); False, with nothing copied, where the
    native pass is not built."""
    return copy_rows_to(target.view.data_ptr(), offsets, staging.data_ptr(), target.page_bytes)


def copy_offsets_torch(staging: torch.Tensor, offsets: torch.Tensor, target: Target) -> None:
    # Row k of the unfolded view is bytes [k, k + page_bytes) of dest: the rows overlap, but
    # validated offsets pick rows that do not, so every byte is written at most once.
    windows = target.view.unfold(0, target.page_bytes, 1)
    pages = staging.reshape(-1).view(torch.uint8).view(offsets.numel(), target.page_bytes)
    windows.index_copy_(0, offsets, pages)


def copy_offsets_host(staging: torch.Tensor, offsets: torch.Tensor, target: Target) -> None:
    """The CPU path of an offsets scatter: one native copy row per page (``index_copy_``
    over an unfolded view ran at a few hundred MB/s: 15.7 MB of 32 KiB pages split in two
    pieces took 4.6 ms); the torch reference where the native pass is not built. Offsets
    were validated: every page lies inside ``target`` and none overlaps another."""
    if not _copy_rows(staging, target, offsets.numpy()):
        copy_offsets_torch(staging, offsets, target)


CopyFn = Callable[[torch.Tensor, torch.Tensor, Target], None]


@dataclass(frozen=True)
class PageCopy:
    """How one kind of scatter copies its pages: on the host, and with torch on a device
    (the reference where the kernel is not built or not wanted)."""

    host: CopyFn
    torch: CopyFn


LAYER_COPY = PageCopy(copy_layer_host, copy_layer_torch)  # into a layer's slots
OFFSETS_COPY = PageCopy(copy_offsets_host, copy_offsets_torch)  # to byte offsets
