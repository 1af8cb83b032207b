"""One FlatCake client of the bench in its own process, pinned to one node (a Ray actor of
``sys_flatcake.py``'s harness), driven through the public API only: puts, restores checked
byte for byte, lookups; concurrent rounds start together at a gate (``workload.start_gate``)
with their bytes made before and checked after the timed window."""

from __future__ import annotations

import time
import zlib
from typing import Any

import numpy as np

from benchmarks.peers.workload import (
    CONTROL_SAMPLES,
    PreparedBytes,
    Workload,
    check_bytes,
    median,
    wait_until,
)
from flatcake_ray.cli.benchkit import await_prewrite

SHORT_CHAT = {"turn": 2, "prior_reply_tokens": 1, "context_tokens": 1}  # -> DRAM
FIRST_TURN = {"turn": 1}  # -> SSD


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode())


class FlatCakeWorker:
    """One FlatCake client in its own process, pinned to one node (a Ray actor)."""

    def __init__(self, namespace: str, workload: Workload) -> None:
        from flatcake_ray.client.client import FlatCakeClient

        self.client = FlatCakeClient(namespace)
        # As a serving replica does at start: NIXL, connections, and its node's arena mapped
        # for puts and reads (else one timed put of a row paid the page tables of a chunk).
        self.client.warm_up()
        self.workload = workload
        self.node_id = self.client.stats(nodes=False)["local_node_id"]
        self._out: dict[int, np.ndarray] = {}
        self._bytes = PreparedBytes(workload)

    def node(self) -> int:
        return self.node_id

    def await_prewrite(self) -> float:
        return await_prewrite(self.client)

    def _hints(self, medium: str) -> Any:
        from flatcake_ray.core.catalog import PutHints

        return PutHints(**(SHORT_CHAT if medium == "DRAM" else FIRST_TURN))

    def seed(self, session: str, medium: str) -> int:
        """Open ``session`` with one page; returns the node its scope was placed on."""
        key = [f"{session}-seed"]
        kv = np.zeros((self.workload.layers, 1, self.workload.page_bytes), np.uint8)
        self.client.put(key, kv, session_id=session, hints=self._hints(medium))
        return self.client.locate(key).node_id

    def prepare(self, session: str, pages: int) -> None:
        """Make ``session``'s bytes before a concurrent round (``workload.PreparedBytes``)."""
        self._bytes.make(session, pages, seed_of(session))

    def put(
        self, session: str, pages: int, medium: str, start_at: float | None = None
    ) -> dict[str, Any]:
        """One put; ``start_at``: a wall-clock time the clients of a round start together."""
        keys = self.workload.keys(session, pages)
        kv = self._bytes.take(session, pages, seed_of(session))
        wait_until(start_at)
        started = time.time()
        result = self.client.put(keys, kv, session_id=session, hints=self._hints(medium))
        ended = time.time()
        owner = self.client.locate(keys).node_id
        return {
            "seconds": ended - started,
            "start": started,
            "end": ended,
            "bytes": kv.nbytes,
            "medium": result.medium,
            "written": result.pages_written,
            "local": owner == self.node_id,
        }

    def _buffer(self, pages: int) -> np.ndarray:
        if pages not in self._out:
            self._out[pages] = np.zeros(
                (self.workload.layers, pages, self.workload.page_bytes), np.uint8
            )
        return self._out[pages]

    def restore_once(
        self, session: str, pages: int, start_at: float | None = None, check: bool = True
    ) -> dict[str, Any]:
        """One restore, checked byte for byte (``check`` off: by ``check_restored``, once the
        round's concurrent restores are over); wall-clock start and end (for aggregates);
        ``start_at``: a wall-clock time the clients of a round start together."""
        keys = self.workload.keys(session, pages)
        out = self._buffer(pages)
        out.fill(0)
        wait_until(start_at)
        started = time.time()
        report = self.client.restore_report(keys, out)
        ended = time.time()
        if report.pages != pages:
            raise AssertionError(
                f"FlatCake restored {report.pages} of {pages} pages of {session} on node "
                f"{self.node_id} (owner {report.node_id}, lease expired {report.lease_expired}, "
                f"failures {report.failures})"
            )
        if check:
            self.check_restored(session, pages)
        return {"start": started, "end": ended, "bytes": out.nbytes, "paths": sorted(report.paths)}

    def check_restored(self, session: str, pages: int) -> None:
        """The last restore of ``pages`` pages holds ``session``'s bytes, byte for byte."""
        expected = self._bytes.of(session, pages, seed_of(session))
        check_bytes(self._buffer(pages), expected, f"FlatCake {session}")

    def restore(self, session: str, pages: int) -> dict[str, Any]:
        """One warm-up, then ``rounds`` timed restores: median seconds."""
        self.restore_once(session, pages)
        runs = [self.restore_once(session, pages) for _ in range(self.workload.rounds)]
        each = [r["end"] - r["start"] for r in runs]
        return {
            "seconds": median(each),
            "rounds_s": each,
            "bytes": runs[0]["bytes"],
            "paths": runs[0]["paths"],
        }

    def control(self, session: str, pages: int) -> dict[str, Any]:
        """``locate(lease=True)``: lookup + lease + release, no bytes; cold and warm cache."""
        keys = self.workload.keys(session, pages)
        cold, warm = [], []
        for _ in range(CONTROL_SAMPLES):
            self.client.forget_locations()
            cold.append(self.client.locate(keys, lease=True))
            warm.append(self.client.locate(keys, lease=True))
        return {
            "warm_ms": median([r.control_seconds * 1e3 for r in warm]),
            "cold_ms": median([r.control_seconds * 1e3 for r in cold]),
            "warm_calls": int(median([r.actor_calls for r in warm])),
            "cold_calls": int(median([r.actor_calls for r in cold])),
            "warm_direct": int(median([r.direct_calls for r in warm])),
            "cold_direct": int(median([r.direct_calls for r in cold])),
        }
