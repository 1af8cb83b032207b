"""Host memory copies split over a few threads: every big copy of the data path goes here.

One core's memcpy does not reach the memory bus's rate, and numpy releases the GIL while it
copies, so a copy of megabytes is cut into pieces that a small pool of threads copies at once
(measured here: 1.2-1.7x a single ``np.copyto`` with two cores; ``benchmarks/stages.py``).
Small copies stay on the caller's thread: below ``SPLIT_BYTES`` a handoff costs more than
it saves. So do all copies while other processes leave this one no idle core: a handoff then
waits for a core, and measured 0.1-0.8x of one thread's copy at load 26 on 2 cores. The cores
left to this process are read from ``/proc/stat`` (idle time) and its own CPU time, at most
once a second, over the last seconds: the load average counts this process's own copy
threads, so a process that copied hard for a minute read it as a busy machine and went down
to one thread. A process whose last reading is older (it waited) goes by the load average.

Where ``cuda_ext/_copyhash.c`` is built, big copies of contiguous arrays go through it
(:func:`run_ops`): one batch of rows that every copy thread works through at once, each
claiming the next rows, at full speed whatever the arrays' alignment; the checksums of
``cuda_ext/host_hash.py`` ride in the same batches.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

# The columns of a native batch (an int64 array, one row an op): copy ``LENGTH`` bytes from
# ``SRC`` to ``DST`` (when ``DST`` is not 0), then hash the ``LENGTH`` bytes at ``HASH_AT``
# (when it is not 0; ``cuda_ext/host_hash.py``).
DST, SRC, LENGTH, HASH_AT = range(4)
ROW_BYTES = 1 << 20  # a thread claims about this many bytes of rows at a time

SPLIT_BYTES = 4 << 20  # a copy smaller than this runs on the caller's thread, whole
PIECE_BYTES = 2 << 20  # a big copy is cut into pieces of about this size
MAX_THREADS = 4
WINDOW_S = 3.0  # the longest span between two CPU readings that still says what is idle now

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


_idle = (0.0, 1)  # (when read, threads worth using then)
_last_cpu: tuple[float, float, float] | None = None  # (when, idle core seconds, own seconds)


def copy_threads() -> int:
    """Threads a big copy is split over: the cores this process may use, at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def idle_threads() -> int:
    """Copy threads worth using now: the cores other processes leave idle (at least 1, at
    most ``copy_threads()``), read at most once a second."""
    global _idle, _last_cpu
    now = time.monotonic()
    when, threads = _idle
    if now - when > 1.0:
        sample = cpu_sample()
        free = _free_since(_last_cpu, sample)
        _last_cpu = sample
        if free is None:  # no /proc/stat, or no reading of the last seconds: the load average
            free = copy_threads() - int(os.getloadavg()[0]) + 1
        threads = max(1, min(copy_threads(), round(free)))
        _idle = (now, threads)
    return threads


def _free_since(
    before: tuple[float, float, float] | None, after: tuple[float, float, float] | None
) -> float | None:
    """:func:`free_cores` between two readings a few seconds apart at most; None otherwise:
    a window reaching back past a wait (many processes that waited, then copy at once)
    would count cores long since taken as idle."""
    if before is None or after is None or not 0 < after[0] - before[0] <= WINDOW_S:
        return None
    return free_cores(before, after)


def cpu_sample() -> tuple[float, float, float] | None:
    """(now, the machine's idle core seconds so far, this process's CPU seconds so far), or
    None where ``/proc/stat`` cannot be read."""
    try:
        with open("/proc/stat", "rb") as stat:
            fields = stat.readline().split()
        idle = (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")  # idle + iowait
    except (OSError, ValueError, IndexError):
        return None
    own = os.times()
    return time.monotonic(), idle, own.user + own.system


def free_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Cores other processes left to this one between two samples: the idle ones plus those
    this process kept busy itself."""
    wall = after[0] - before[0]
    return max(0.0, (after[1] - before[1] + after[2] - before[2]) / wall)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(copy_threads(), thread_name_prefix="flatcake-copy")
        return _pool


def _flat(array: np.ndarray) -> np.ndarray | None:
    """A 1-D uint8 view of a C-contiguous array, else None."""
    if not array.flags.c_contiguous:
        return None
    return array.reshape(-1).view(np.uint8)


def _pieces(dst: np.ndarray, src: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(dst, src)`` cut into pieces of about ``PIECE_BYTES`` (flat when both are contiguous,
    else along the first axis)."""
    flat_dst, flat_src = _flat(dst), _flat(src)
    if flat_dst is not None and flat_src is not None:
        count = max(1, flat_dst.size // PIECE_BYTES)
        bounds = np.linspace(0, flat_dst.size, count + 1, dtype=np.int64).tolist()
        return [(flat_dst[a:b], flat_src[a:b]) for a, b in itertools.pairwise(bounds)]
    if dst.ndim == 0 or dst.shape[0] < 2:
        return [(dst, src)]
    row_bytes = max(1, dst.nbytes // dst.shape[0])
    step = max(1, PIECE_BYTES // row_bytes)
    return [(dst[a : a + step], src[a : a + step]) for a in range(0, dst.shape[0], step)]


def copy_many(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """``np.copyto(dst, src)`` for every ``(dst, src)`` pair (same shapes, no overlaps between
    pairs), the bytes spread over the copy threads when there are enough of them. Big
    copies of contiguous arrays of one dtype go through the native pass where it is built
    (any alignment at full speed, ``cuda_ext/_copyhash.c``); small ones stay with numpy,
    whose call costs half as much (33 against 63 us for 1.4 MB in three pairs)."""
    module = native_module()
    if module is not None and sum(dst.nbytes for dst, _ in pairs) >= SPLIT_BYTES:
        flat = [_native_pair(dst, src) for dst, src in pairs]
        rows = [row for row in flat if row is not None]
        if rows:
            run_ops(module, np.array(rows, dtype=np.int64), 0)
        pairs = [pair for pair, row in zip(pairs, flat, strict=True) if row is None]
    total = sum(dst.nbytes for dst, _ in pairs)
    threads = idle_threads() if total >= SPLIT_BYTES else 1
    if threads == 1:
        for dst, src in pairs:
            np.copyto(dst, src)
        return
    pieces = [piece for dst, src in pairs for piece in _pieces(dst, src)]
    share = -(-total // threads)
    groups: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    filled = 0
    for piece in pieces:
        if filled >= share and len(groups) < threads:
            groups.append([])
            filled = 0
        groups[-1].append(piece)
        filled += piece[0].nbytes
    run_split([functools.partial(_copy_group, group) for group in groups])


def _native_pair(dst: np.ndarray, src: np.ndarray) -> tuple[int, int, int, int] | None:
    """A native copy row for ``dst <- src`` (contiguous, one dtype and shape, apart), or None."""
    if not (dst.flags.c_contiguous and src.flags.c_contiguous and dst.flags.writeable):
        return None
    if dst.dtype != src.dtype or dst.shape != src.shape or np.may_share_memory(dst, src):
        return None
    return (dst.ctypes.data, src.ctypes.data, dst.nbytes, 0) if dst.nbytes else None


@functools.cache
def native_module() -> Any:
    """``cuda_ext/_copyhash`` (built by pip install), or None where it was not built."""
    try:
        return importlib.import_module("flatcake_ray.cuda_ext._copyhash")
    except ImportError:
        return None


def op_rows(dst: Any, src: Any, length: Any, hash_at: Any = 0) -> np.ndarray:
    """Native op rows from their columns: addresses and lengths, arrays of one length or
    single values (broadcast); ``hash_at`` 0 where a row hashes nothing."""
    arrays = [np.size(column) for column in (dst, src, length, hash_at) if np.ndim(column)]
    count = max(arrays) if arrays else 1
    ops = np.empty((count, 4), dtype=np.int64)
    ops[:, DST], ops[:, SRC], ops[:, LENGTH], ops[:, HASH_AT] = dst, src, length, hash_at
    return ops


def copy_rows_to(dst: int, offsets: np.ndarray, src: int, row_bytes: int) -> bool:
    """Row ``i`` of the ``row_bytes`` rows back to back at address ``src`` to address
    ``dst + offsets[i]``, one native copy row each (the caller has checked that every row
    lies in live memory and none overlaps another); False, with nothing copied, where the
    native pass is not built."""
    module = native_module()
    if module is None:
        return False
    sources = src + np.arange(len(offsets), dtype=np.int64) * row_bytes
    run_ops(module, op_rows(dst + offsets, sources, row_bytes), 0)
    return True


def run_ops(module: Any, ops: np.ndarray, address: int) -> np.ndarray:
    """A batch of native ops (int64 rows ``DST, SRC, LENGTH, HASH_AT``; every address a valid
    range of the caller's live arrays; ``address``: XXH3's, 0 where no row hashes) on the
    idle copy threads, each thread claiming the next rows; returns each row's hash (0 where
    it hashes nothing). A long row that only copies is cut first, so that no thread is left
    alone with one big row at the end."""
    ops = np.ascontiguousarray(ops, dtype=np.int64).reshape(-1, 4)
    threads = batch_threads(ops[:, LENGTH])
    long = (ops[:, HASH_AT] == 0) & (ops[:, LENGTH] > ROW_BYTES)
    work = np.concatenate([ops[~long], _cut(ops[long])]) if threads > 1 and long.any() else ops
    sums = np.zeros(len(work), dtype=np.uint64)
    claimed = np.zeros(1, dtype=np.int64)
    step = claim_step(work[:, LENGTH], threads)
    run_split([functools.partial(module.copy_hash, work, sums, claimed, address, step)] * threads)
    if work is ops:
        return sums
    found = np.zeros(len(ops), dtype=np.uint64)
    found[~long] = sums[: int((~long).sum())]
    return found


def batch_threads(lengths: np.ndarray) -> int:
    """Threads a native batch of rows of ``lengths`` bytes runs on: the idle ones where it is
    ``SPLIT_BYTES`` or more, one otherwise, never more than its rows."""
    total = int(lengths.sum())
    return min(idle_threads() if total >= SPLIT_BYTES else 1, max(1, len(lengths)))


def claim_step(lengths: np.ndarray, threads: int) -> int:
    """Rows a thread claims at a time: about ``ROW_BYTES`` of them (all, on one thread)."""
    if threads == 1 or not len(lengths):
        return max(1, len(lengths))
    mean = max(1, int(lengths.sum()) // len(lengths))
    return max(1, ROW_BYTES // mean)


def _cut(rows: np.ndarray) -> np.ndarray:
    """Copy-only ``rows`` cut into rows of at most ``ROW_BYTES``."""
    pieces = -(-rows[:, LENGTH] // ROW_BYTES)
    owner = np.repeat(np.arange(len(rows)), pieces)
    within = np.arange(len(owner)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    skip = within * ROW_BYTES
    cut = rows[owner].copy()
    cut[:, DST] += skip
    cut[:, SRC] += skip
    cut[:, LENGTH] = np.minimum(ROW_BYTES, rows[owner, LENGTH] - skip)
    return cut


def run_split(tasks: Sequence[Callable[[], None]]) -> None:
    """Run ``tasks`` at once on the copy threads, the first on the caller's (one handoff
    fewer); returns when all are done, raising the first error after all ended."""
    futures = [_executor().submit(task) for task in tasks[1:]]
    try:
        if tasks:
            tasks[0]()
    finally:
        errors = []
        for future in futures:
            try:
                future.result()
            except BaseException as exc:  # raised below, once every task has ended
                errors.append(exc)
    if errors:
        raise errors[0]


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)``, split over the copy threads when big."""
    copy_many([(dst, src)])


def _copy_group(group: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in group:
        np.copyto(dst, src)
