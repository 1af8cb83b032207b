"""Running a checked scatter: on the CPU the host copy, on a CUDA device the nvcc-built
kernel on the caller's stream, or the torch reference there when the kernel is not built
(logged once) or not wanted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import torch

from flatcake_ray.cuda_ext import _library
from flatcake_ray.cuda_ext._library import ScatterLibrary, ScatterLibraryError
from flatcake_ray.cuda_ext._targets import PageCopy, Target
from flatcake_ray.errors import ShapeError

log = logging.getLogger(__name__)

Backend = Literal["auto", "kernel", "torch"]
BACKENDS: tuple[Backend, ...] = ("auto", "kernel", "torch")

_fallback_logged = False


def dispatch(
    staging: torch.Tensor,
    ids: torch.Tensor,
    target: Target,
    stream: torch.cuda.Stream | int | None,
    backend: Backend,
    validate: Callable[[torch.Tensor], None] | None,
    copy: PageCopy,
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
        copy_on_host(copy, staging, ids.to(torch.int64), target)
        return
    cuda_stream = _resolve_stream(stream, device)
    library = None if backend == "torch" else _library_for(backend)
    with torch.cuda.device(device), torch.cuda.stream(cuda_stream):
        if validate is not None:
            validate(ids)  # on the caller's stream, which orders ids after their producer
        # Allocated under the stream, so the caching allocator orders its reuse after us.
        device_ids = ids.to(device=device, dtype=torch.int64).contiguous()
        if library is None:
            copy.torch(staging, device_ids, target)
        else:
            _launch(library, staging, device_ids, target, device, cuda_stream)


def copy_on_host(copy: PageCopy, staging: torch.Tensor, ids: torch.Tensor, target: Target) -> None:
    """The CPU copy (a function of its own: ``benchmarks/stage_clock.py`` times it)."""
    copy.host(staging, ids, target)


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


def _launch(library: ScatterLibrary, staging, device_ids, target: Target, device, stream) -> None:
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
