"""A sealed SSD layer onto the drive: sealed a piece at a time while the piece before it is
written, so the cipher's time hides behind the drive's (sealing a whole layer and then
writing it ran the local SSD put at 0.79 of a plain one: ``benchmarks/sealed_ssd.py``)."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from flatcake_ray.core.layout import SegmentLayout
from flatcake_ray.cuda_ext.host_seal import seal_layer
from flatcake_ray.media.pool import SsdPool

PIECE_BYTES = 8 << 20  # a multiple of the O_DIRECT alignment
_writers: ThreadPoolExecutor | None = None
_writers_lock = threading.Lock()


def _writer() -> ThreadPoolExecutor:
    global _writers
    with _writers_lock:
        if _writers is None:
            _writers = ThreadPoolExecutor(1, thread_name_prefix="flatcake-sealed-write")
        return _writers


def seal_and_write(
    pool: SsdPool,
    offset: int,
    block: np.ndarray,
    key: bytes,
    layout: SegmentLayout,
    sums: np.ndarray,
) -> int:
    """Seal ``block`` (a layer's ``layer_stride`` aligned bytes, its pages first) in place
    and write it at pool ``offset``; returns the drive commands it took. Every write is
    waited for before an error is raised."""
    cuts = [*range(0, block.nbytes, PIECE_BYTES), block.nbytes]
    pending: Future[None] | None = None
    try:
        for lo, hi in itertools.pairwise(cuts):
            seal_layer(key, block, layout, sums, lo, hi)
            if pending is not None:
                pending.result()
            pending = _writer().submit(pool.write, offset + lo, block[lo:hi])
        written, pending = pending, None
        if written is not None:
            written.result()
    finally:
        if pending is not None:
            pending.exception()  # let the write in flight end before the error goes up
    return len(cuts) - 1
