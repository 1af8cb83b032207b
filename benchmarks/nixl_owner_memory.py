"""Raw NIXL READ rates by the memory the owner exports and the memory they land in.

``make bench-peers`` sets remote DRAM rows against one raw NIXL READ between two processes
whose buffers are numpy arrays (anonymous memory, which numpy asks the kernel to back with
transparent huge pages). A storage node cannot export such memory: its arena is memfd chunks
(``media/arena.py``: a chunk has no path and is handed to a tenant's client as a
descriptor), and shared memory gets huge pages only where the administrator enabled them
(``/sys/kernel/mm/transparent_hugepage/shmem_enabled``) or reserved hugetlb pages (the arena
takes them when reserved: ``hugepages`` in the config). Over UCX on one machine a READ is a
cross-memory copy (``process_vm_readv``) run by the reader's posting thread, and its rate
depends on the pages on both sides. This measures it, in fresh processes, with the same
agents the service uses (an owner pumped by ``exporter_agent``, a reader that progresses its
own requests):

- owner memory: ``numpy`` (what the bench-peers limit reads) or ``arena`` (a ``DramArena``
  of the service's chunk size, what a storage node exports);
- reads: ``one`` (one READ of the whole request into a request-sized buffer, as the limit
  does) or ``slots`` (16 MiB READs into two reused 16 MiB buffers, as a restore's staging
  window does) or ``into place`` (16 MiB READs into a request-sized buffer, one after the
  other, as reading straight into an engine's memory would).

Both with UCX's default transports and with ``UCX_TLS=tcp`` (bench-peers' two columns). Run:
``.venv/bin/python -m benchmarks.nixl_owner_memory [--mib 224] [--rounds 7] [--aligned]``;
prints a Markdown table of median GB/s and the machine's huge page settings.

The reader's buffers are numpy arrays (16 bytes past a page boundary, as numpy places large
arrays), or with ``--aligned`` start on a page, as a restore's staging slots do. It matters:
the kernel's copy runs at about half its rate where source and destination are not aligned
alike, and a numpy owner is aligned as a numpy reader is while an arena starts on a page.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.peers.limits import UCX_MODES, answer, environment, spawn, stop

SLOT_BYTES = 16 << 20
OWNERS = ("numpy", "arena")
READS = ("one", "slots", "into place")


def _owner(conn: Any, kind: str, nbytes: int) -> None:
    try:
        from flatcake_ray.actors.nixl_roles import exporter_agent
        from flatcake_ray.media.arena import DramArena
        from flatcake_ray.transports.nixl_dram import NixlArenaExporter

        if kind == "numpy":
            memory, chunk, keep = np.full(nbytes, 7, dtype=np.uint8), 0, None
        else:
            keep = DramArena(nbytes, f"bench-{os.getpid()}", chunk_bytes=nbytes // 8)
            memory, chunk = keep.view, keep.chunk_bytes
            memory[:] = 7
        agent = exporter_agent(f"owner-memory-{os.getpid()}")
        exporter = NixlArenaExporter("owner", memory, agent=agent, chunk_bytes=chunk)
        peer = exporter.peer_info()
        conn.send((peer.metadata, peer.base_address, peer.chunks))
        while not conn.poll(0.1):
            agent.wake()  # the pump polls at full rate, as a node's does while leases are out
        exporter.close()
        agent.close()
    except Exception as exc:  # handed to the parent, which raises it
        conn.send(exc)


def _reader(
    conn: Any, metadata: bytes, base: int, chunks: Any, nbytes: int, rounds: int, aligned: bool
) -> None:
    try:
        from flatcake_ray.actors.nixl_roles import reader_agent
        from flatcake_ray.cli.benchkit import aligned_buffer
        from flatcake_ray.transports.nixl_dram import descriptors

        def buffer(size: int) -> np.ndarray:
            return aligned_buffer(size) if aligned else np.zeros(size, dtype=np.uint8)

        agent = reader_agent(f"reader-memory-{os.getpid()}")
        peer = agent.add_peer(metadata)
        request = buffer(nbytes)
        slots = [buffer(SLOT_BYTES) for _ in range(2)]
        bounds = [start for start, _ in chunks] + [nbytes]

        def read(dst: np.ndarray, at: int, src: int, length: int) -> None:
            while length:  # a READ never spans two of the owner's registrations
                cut = min(b for b in bounds if b > src) - src
                step = min(length, cut)
                local = descriptors(np.array([dst.ctypes.data + at]), np.array([step]))
                remote = descriptors(np.array([base + src]), np.array([step]))
                with agent.destinations.use(dst):
                    agent.read(peer, local, remote, "DRAM", timeout_s=30, dst=dst)
                at, src, length = at + step, src + step, length - step

        def pieces() -> list[tuple[int, int]]:
            return [(s, min(SLOT_BYTES, nbytes - s)) for s in range(0, nbytes, SLOT_BYTES)]

        ways = {
            "one": lambda: read(request, 0, 0, nbytes),
            "slots": lambda: [read(slots[i % 2], 0, s, n) for i, (s, n) in enumerate(pieces())],
            "into place": lambda: [read(request, s, s, n) for s, n in pieces()],
        }
        times: dict[str, list[float]] = {way: [] for way in READS}
        for _ in range(rounds + 1):  # the first round warms up (connection, registrations)
            for way in READS:
                start = time.perf_counter()
                ways[way]()
                times[way].append(time.perf_counter() - start)
        if not (request == 7).all():
            raise AssertionError("a READ delivered other bytes")
        conn.send({way: nbytes / statistics.median(t[1:]) / 1e9 for way, t in times.items()})
    except Exception as exc:  # handed to the parent, which raises it
        conn.send(exc)


def measure(
    kind: str, nbytes: int, rounds: int, ucx_tls: str | None, aligned: bool
) -> dict[str, float]:
    with environment(UCX_TLS=ucx_tls):
        owner, owner_conn = spawn(_owner, kind, nbytes)
        try:
            return _read_from(owner_conn, nbytes, rounds, aligned)
        finally:
            owner_conn.send("done")
            stop(owner, owner_conn)


def _read_from(owner_conn: Any, nbytes: int, rounds: int, aligned: bool) -> dict[str, float]:
    metadata, base, chunks = answer(owner_conn)
    reader, reader_conn = spawn(_reader, metadata, base, chunks, nbytes, rounds, aligned)
    try:
        return answer(reader_conn)
    finally:
        stop(reader, reader_conn)


def huge_page_settings() -> str:
    root = Path("/sys/kernel/mm/transparent_hugepage")
    found = []
    for name in ("enabled", "shmem_enabled"):
        try:
            found.append(f"THP {name}: {(root / name).read_text().strip()}")
        except OSError:
            found.append(f"THP {name}: unreadable")
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    found += [line.replace("  ", "") for line in meminfo if line.startswith("HugePages_Total")]
    return "; ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=224, help="MiB a request reads")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (medians)")
    parser.add_argument("--aligned", action="store_true", help="reader buffers start on a page")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    nbytes = args.mib << 20
    load = os.getloadavg()[0]
    rows = {
        (mode, kind): measure(kind, nbytes, args.rounds, tls, args.aligned)
        for mode, tls in UCX_MODES.items()
        for kind in OWNERS
    }
    where = "on a page" if args.aligned else "numpy arrays"
    print(f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after; {huge_page_settings()}")
    print(f"reader buffers: {where}")
    print()
    print("| UCX | owner memory | " + " | ".join(f"{way} GB/s" for way in READS) + " |")
    print("|---|---|" + "---:|" * len(READS))
    for (mode, kind), row in rows.items():
        print(f"| {mode} | {kind} | " + " | ".join(f"{row[way]:.2f}" for way in READS) + " |")


if __name__ == "__main__":
    main()
