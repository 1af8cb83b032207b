"""Which side of a cross-memory copy sets its rate: the process whose pages are pinned.

Over UCX on one machine a NIXL transfer is a cross-memory copy (``process_vm_readv`` for a
READ, ``process_vm_writev`` for a WRITE, 512 KiB a call) run by the process that posted it.
The kernel pins the *other* process's pages one at a time and copies to or from its own
through its page tables. So a READ of a node's arena by a reader pins the arena's pages
(shared memory: 4 KiB pages where ``shmem_enabled`` is ``never``), while the same bytes pushed
by the owner (a WRITE) pin the reader's pages (private anonymous memory that asked for huge
pages, as a restore's slots are). This times the four directions between a memfd region (an
arena's kind of memory) and a huge-page anonymous one (a slot's or a client buffer's kind),
both page-aligned, in two fresh processes, the raw system calls alone (no NIXL, no checks).

Run: ``python -m benchmarks.cma_pinned_side [--mib 224] [--rounds 7]``; prints median GB/s
and the machine's huge page settings.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

SEGMENT = 512 << 10  # what UCX's CMA transport moves a call
HUGE = 2 << 20
MADV_HUGEPAGE = 14
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _memfd_region(nbytes: int) -> tuple[mmap.mmap, int]:
    """Shared memory as an arena chunk is: a memfd, mapped shared, written once."""
    fd = os.memfd_create("cma-arena")
    try:
        os.ftruncate(fd, nbytes)
        region = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    region[:] = b"\x07" * nbytes
    return region, ctypes.addressof(ctypes.c_char.from_buffer(region))


def _anonymous_region(nbytes: int) -> tuple[mmap.mmap, int]:
    """Private anonymous memory on a 2 MiB boundary that asked for huge pages first."""
    region = mmap.mmap(-1, nbytes + HUGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    start = base + (-base) % HUGE
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    ctypes.memset(start, 1, nbytes)
    return region, start


def _copy_seconds(call: Any, pid: int, local: int, remote: int, nbytes: int) -> float:
    started = time.perf_counter()
    for at in range(0, nbytes, SEGMENT):
        length = min(SEGMENT, nbytes - at)
        mine, theirs = _IoVec(local + at, length), _IoVec(remote + at, length)
        if call(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0) != length:
            raise OSError(ctypes.get_errno(), "cross-memory copy failed")
    return time.perf_counter() - started


def _holder(kind: str, nbytes: int, rounds: int, conn: Any) -> None:
    region, start = (_memfd_region if kind == "memfd" else _anonymous_region)(nbytes)
    conn.send((os.getpid(), start))
    while (asked := conn.recv()) is not None:
        op, pid, remote = asked
        call = _libc.process_vm_writev if op == "write" else _libc.process_vm_readv
        times = [_copy_seconds(call, pid, start, remote, nbytes) for _ in range(rounds + 1)]
        conn.send(statistics.median(times[1:]))
    region.close()


def measure(nbytes: int, rounds: int) -> dict[str, float]:
    """GB/s of each direction, medians of ``rounds`` after a warm-up."""
    ctx = mp.get_context("spawn")
    ends, procs, where = {}, [], {}
    for kind in ("memfd", "anonymous"):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_holder, args=(kind, nbytes, rounds, theirs))
        proc.start()
        ends[kind], where[kind] = ours, ours.recv()
        procs.append(proc)
    asks = {  # label: (who posts, op, whose memory is pinned)
        "READ by the huge-page side (pins the memfd's pages: a restore's READ)": (
            "anonymous", "read", "memfd"),
        "WRITE by the memfd side (pins the huge pages: an owner pushing)": (
            "memfd", "write", "anonymous"),
        "WRITE by the huge-page side (pins the memfd's pages: a put's WRITE)": (
            "anonymous", "write", "memfd"),
        "READ by the memfd side (pins the huge pages: an owner pulling a put)": (
            "memfd", "read", "anonymous"),
    }  # fmt: skip
    out = {}
    try:
        for label, (poster, op, pinned) in asks.items():
            ends[poster].send((op, *where[pinned]))
            out[label] = nbytes / ends[poster].recv() / 1e9
    finally:
        for end in ends.values():
            end.send(None)
        for proc in procs:
            proc.join()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cma_pinned_side")
    parser.add_argument("--mib", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    print(
        f"shmem_enabled: {(thp / 'shmem_enabled').read_text().strip()}; "
        f"enabled: {(thp / 'enabled').read_text().strip()}; load {os.getloadavg()[0]:.2f}"
    )
    print("| cross-memory copy, 512 KiB calls | GB/s |\n|---|---:|")
    for label, gbps in measure(args.mib << 20, args.rounds).items():
        print(f"| {label} | {gbps:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
