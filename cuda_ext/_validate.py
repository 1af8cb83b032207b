"""Argument checks of the scatter functions; each failure is a :class:`ShapeError`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from flatcake_ray.errors import ShapeError

# Same-width integer views make every copy bit-exact (NaN payloads included).
BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
INDEX_DTYPES = (torch.int32, torch.int64)


def require_tensor(value: object, name: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise ShapeError(f"{name} must be a torch.Tensor, not {type(value).__name__}")


def require_bit_view(tensor: torch.Tensor) -> None:
    if tensor.element_size() not in BIT_VIEWS or tensor.is_complex():
        raise ShapeError(f"unsupported pool dtype {tensor.dtype} (element size 1, 2, 4 or 8)")


def contiguous_page_elems(pool: torch.Tensor, first_page_dim: int) -> int:
    """Elements per page; raises unless the page dims are laid out densely, row-major."""
    expected_stride = 1
    for dim in reversed(range(first_page_dim, pool.dim())):
        if pool.shape[dim] != 1 and pool.stride(dim) != expected_stride:
            raise ShapeError(
                f"each page of the pool must be contiguous; strides "
                f"{pool.stride()} for shape {tuple(pool.shape)}"
            )
        expected_stride *= pool.shape[dim]
    return math.prod(pool.shape[first_page_dim:])


def as_index_tensor(values: torch.Tensor | Sequence[int], name: str) -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        try:
            values = torch.as_tensor(list(values), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ShapeError(f"{name} must be a 1-D tensor or sequence of ints: {exc}") from exc
    if values.dim() != 1 or values.dtype not in INDEX_DTYPES:
        raise ShapeError(
            f"{name} must be 1-D int32 or int64, got {values.dtype} shape {tuple(values.shape)}"
        )
    return values


def check_staging(staging: torch.Tensor, dest: torch.Tensor, pages: int, page_bytes: int) -> None:
    require_tensor(staging, "staging")
    if staging.dtype not in (torch.uint8, dest.dtype):
        raise ShapeError(f"staging dtype must be uint8 or {dest.dtype}, not {staging.dtype}")
    if not staging.is_contiguous():
        raise ShapeError("staging must be contiguous (pages back to back, in request order)")
    staged = staging.numel() * staging.element_size()
    if staged != pages * page_bytes:
        raise ShapeError(
            f"staging holds {staged} bytes; {pages} pages of {page_bytes} bytes "
            f"need exactly {pages * page_bytes}"
        )


def check_devices(staging: torch.Tensor, dest: torch.Tensor, ids: torch.Tensor, stream) -> None:
    if staging.device != dest.device:
        raise ShapeError(f"staging is on {staging.device} but the destination is on {dest.device}")
    if ids.device not in (dest.device, torch.device("cpu")):
        raise ShapeError(f"indices are on {ids.device}; use the CPU or {dest.device}")
    if stream is not None and dest.device.type != "cuda":
        raise ShapeError(f"stream given, but the tensors are on {dest.device}, not CUDA")


def check_slot_ids(ids: torch.Tensor, num_slots: int) -> None:
    if ids.numel() == 0:
        return
    low, high, min_gap = sorted_summary(ids)
    if low < 0 or high >= num_slots:
        raise ShapeError(f"slot ids must be in [0, {num_slots}); got min {low}, max {high}")
    if min_gap == 0:
        raise ShapeError("slot ids must be distinct; two pages name the same slot")


def check_byte_offsets(offsets: torch.Tensor, page_bytes: int, index_limit: int) -> None:
    if offsets.numel() == 0:
        return
    low, high, min_gap = sorted_summary(offsets)
    if low < 0 or high >= index_limit:
        raise ShapeError(
            f"byte offsets must be in [0, {index_limit - 1}] so a page of "
            f"{page_bytes} bytes fits; got min {low}, max {high}"
        )
    if min_gap < page_bytes:
        raise ShapeError(
            f"destination pages overlap: two offsets are {min_gap} bytes apart, "
            f"less than page_bytes={page_bytes}"
        )


def sorted_summary(ids: torch.Tensor) -> tuple[int, int, float]:
    """(min, max, smallest gap between sorted values) with one device-to-host transfer."""
    ordered = torch.sort(ids.to(torch.int64)).values
    if ordered.numel() == 1:
        only = int(ordered[0])
        return only, only, math.inf
    gaps = torch.diff(ordered)
    low, high, min_gap = torch.stack([ordered[0], ordered[-1], gaps.min()]).tolist()
    return low, high, min_gap
