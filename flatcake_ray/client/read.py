"""The client's read of one lease reply: route each part by its GVA, read it, check it.

Parts are grouped by (path, medium). DRAM parts are one batch of page runs straight into the
caller's buffer; SSD parts are read a window at a time into staging (the next window is read
while this one is checked and scattered) and every layer extent's checksum is verified. A
part whose transport fails, or whose checksum does not match, ends the restored prefix
there: a miss, never wrong bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from flatcake_ray.actors.protocol import LeaseReply
from flatcake_ray.client.io import (
    PathTally,
    RestoreReport,
    deliver_window,
    dram_batch,
    first_bad_position,
    ssd_windows,
    window_batch,
)
from flatcake_ray.client.nodes import NodeLink, NodeTable
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.gva import encode as encode_gva
from flatcake_ray.errors import (
    PeerDisconnectedError,
    ReadRangeError,
    TransferError,
    TransferTimeoutError,
)
from flatcake_ray.media.buffers import AlignedBuffer
from flatcake_ray.transports.routing import route


def _read_errors() -> tuple[type[BaseException], ...]:
    """What a failed part may raise: a transfer error, or the owner's own error carried by
    Ray (object-store fallback, shipped SSD). Each turns that part into a miss."""
    from ray.exceptions import RayError

    return (TransferError, ReadRangeError, OSError, RayError)


def _node_gone(exc: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(exc, PeerDisconnectedError | TransferTimeoutError | RayActorError)


class LeaseReader:
    def __init__(
        self,
        nodes: NodeTable,
        layers: int,
        window_bytes: int,
        allowed: frozenset[str],
        agents: Callable[[str], Any],
    ) -> None:
        self.nodes = nodes
        self.layers = layers
        self.window_bytes = window_bytes
        self.allowed = allowed
        self._agents = agents
        # Page-aligned, so O_DIRECT reads of whole extents land in them with no bounce copy.
        self._ssd_buffers = [AlignedBuffer(window_bytes) for _ in range(2)]
        self._window_lock = threading.Lock()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flatcake-client-io")

    def close(self) -> None:
        self._io.shutdown(wait=True)

    def route(self, link: NodeLink, part: Any) -> str:
        gva = encode_gva(part.medium, link.node_id, part.offset)
        return route(gva, self.nodes.local_node_id, link.available(self.allowed))

    def read(
        self, link: NodeLink, reply: LeaseReply, view: np.ndarray, report: RestoreReport
    ) -> set[int]:
        """Read every part of ``reply`` into ``view``; sets report.pages; returns the scopes
        whose checksums failed (the owner re-checks them)."""
        parts = list(reply.parts)
        groups: dict[tuple[str, Medium], list[int]] = {}
        for i, part in enumerate(parts):
            groups.setdefault((self.route(link, part), part.medium), []).append(i)
        bad: set[int] = set()
        corrupt: set[int] = set()
        started = time.perf_counter()
        for (path, medium), members in groups.items():
            sub = [parts[i] for i in members]
            try:
                transport, lock = link.transport(path, medium, self._agents)
                with lock:
                    calls_before = getattr(transport, "actor_calls", 0)
                    failed = self._read_group(transport, medium, sub, view, report.tally(path))
                    report.actor_calls += getattr(transport, "actor_calls", 0) - calls_before
            except _read_errors() as exc:
                report.failures.append(f"{path}: {exc}")
                bad.update(members)
                if _node_gone(exc):
                    self.nodes.mark_down(link, f"{path}: {exc}")
                continue
            corrupt.update(members[i] for i in failed)
        report.data_seconds = time.perf_counter() - started
        report.pages = first_bad_position(parts, bad | corrupt, reply.hits)
        return {parts[i].scope_id for i in corrupt}

    def _read_group(
        self, transport: Any, medium: Medium, parts: list, view: np.ndarray, tally: PathTally
    ) -> set[int]:
        """Read ``parts`` of one path into ``view``; returns the parts whose checksum failed."""
        flat = view.reshape(-1)
        pages = sum(len(p.src_pages) for p in parts)
        if medium is Medium.DRAM:
            tally.add(transport.read(dram_batch(parts, self.layers, view.shape[1]), flat), pages)
            return set()
        bad: set[int] = set()
        windows = ssd_windows(parts, self.layers, self.window_bytes)
        with self._window_lock:  # SSD windows are read one ahead of the check-and-scatter
            pending = self._window_read(transport, windows, 0)
            for i, window in enumerate(windows):
                staging, stats = pending.result()
                pending = self._window_read(transport, windows, i + 1)
                tally.add(stats, 0)
                deliver_window(window, parts, staging, view, bad)
            pending.result()
        tally.pages += pages
        return bad

    def _window_read(self, transport: Any, windows: list, i: int) -> Future:
        if i >= len(windows):
            done: Future = Future()
            done.set_result((None, None))
            return done
        batch = window_batch(windows[i])
        if batch.total_bytes > self._ssd_buffers[i % 2].nbytes:  # an extent over a window
            self._ssd_buffers[i % 2] = AlignedBuffer(batch.total_bytes)  # kept for next time
        staging = self._ssd_buffers[i % 2].array
        return self._io.submit(lambda: (staging, transport.read(batch, staging)))
