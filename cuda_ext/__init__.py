"""The page-scatter step of a restore: a CUDA kernel (nvcc-built, loaded with ctypes) and
its torch reference. See :mod:`flatcake_ray.cuda_ext.scatter`.

Importing this package imports neither torch nor the library: the names below resolve on
first access, and the library loads on the first CUDA scatter. Build it with
``python -m flatcake_ray.cuda_ext.build``.
"""

from __future__ import annotations

import importlib
from typing import Any

_SCATTER_NAMES = frozenset(
    {
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
    }
)

__all__ = sorted(_SCATTER_NAMES)


def __getattr__(name: str) -> Any:
    if name in _SCATTER_NAMES:
        return getattr(importlib.import_module(f"{__name__}.scatter"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
