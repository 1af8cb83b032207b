"""Host memory page-locked for CUDA (``cudaHostRegister``), so copies from it to a GPU are DMA
instead of staged by the driver through its own pinned buffer, a chunk at a time.

Through torch's cudart binding, and only in a process that has already loaded torch and sees a
GPU: nothing here imports torch or initialises CUDA for a process that has not. Registered:
a store's DRAM arena (``media/arena.py``) and a GPU restore pipeline's host staging slots
(``restore/pipeline.py``).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from flatcake_ray.media.log import log_once


def cudart() -> Any | None:
    """torch's cudart where torch is loaded and a GPU is visible, else None."""
    torch = sys.modules.get("torch")  # never import CUDA just for this
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.cudart()


def register(view: np.ndarray, what: str) -> bool:
    """Page-lock ``view``'s bytes (contiguous, page-aligned); False, logged once per ``what``,
    where CUDA is absent or refuses (copies from it are then staged, slower)."""
    runtime = cudart()
    if runtime is None or not view.nbytes:
        return False
    result = runtime.cudaHostRegister(view.ctypes.data, view.nbytes, 0)
    if int(result) != 0:
        log_once(f"cudareg-{what}", "cudaHostRegister of %s failed: %s", what, result)
        return False
    return True


def unregister(view: np.ndarray) -> None:
    """Undo :func:`register` for the same ``view`` (before its memory is unmapped)."""
    runtime = cudart()
    if runtime is not None:
        runtime.cudaHostUnregister(view.ctypes.data)
