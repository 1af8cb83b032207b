"""One node's half of ``flatcake-ray replay --live``: a client on that node that replays its
requests against the running service, with real bytes, on the trace's (scaled) clock.

A request is what a serving engine on this node does with the store: its pages are looked up
and restored (``restore_report``: lookup, lease, reads, checks, scatter, release), then all
its pages are put (``put``: the store skips those it holds, write-once) with the session and
the hints the engine would give (:func:`~flatcake_ray.replay.pages.put_hints`, the model's
own). A node runs its requests one after another, as one prefill engine does; a request that
arrives while an earlier one runs waits (its wait is recorded apart from its restore time).

A page's bytes are a function of its key and layer, so every restored page is checked.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from flatcake_ray.core.records import PutHints
from flatcake_ray.replay.pages import TracePages, put_hints


def page_bytes_for(keys: np.ndarray, layers: int, page_bytes: int) -> np.ndarray:
    """``[layers, len(keys), page_bytes]`` uint8: each page's words are ``key * 131 + layer``
    (cheap to make and to check; distinct for distinct keys and layers)."""
    words = keys.astype(np.uint64)[None, :] * np.uint64(131)
    words = words + np.arange(layers, dtype=np.uint64)[:, None]
    shape = (layers, len(keys), page_bytes // 8)
    return np.ascontiguousarray(np.broadcast_to(words[:, :, None], shape)).view(np.uint8)


def medium_of_path(path: str) -> str:
    """The medium a restore path reads (transports/base.py names: local-dram, remote-ssd-...)."""
    return "ssd" if "ssd" in path else "dram"


class LiveNode:
    """A client on one node, replaying that node's requests (wrapped with ray.remote)."""

    def __init__(self, namespace: str, pages: TracePages) -> None:
        from flatcake_ray.client.client import FlatCakeClient

        self.client = FlatCakeClient(namespace)
        self.pages, self.start_at = pages, 0.0
        self.layers, self.page_bytes = self.client.layers, self.client.page_bytes
        largest = int(np.diff(pages.offsets).max()) if len(pages) else 1
        self.out = np.zeros((self.layers, max(largest, 1), self.page_bytes), dtype=np.uint8)

    def where(self) -> dict[str, Any]:
        """This node's ids and its store's config (from this node's environment), once the
        client has paid its one-time costs (paths probed, connections, the pipeline)."""
        self.client.warm_up()
        self.client.pipeline()
        node_id = self.client.nodes.local_node_id
        config = self.client.config.store_config(self.client.ray_node_id, node_id)
        return {"ray_node_id": self.client.ray_node_id, "node_id": node_id, "store": config}

    def stats(self) -> dict[str, Any]:
        """This client's counters and its node's stats."""
        found = self.client.stats()
        return {"client": found["client"], "node": found["nodes"].get(found["local_node_id"])}

    def calibrate(self, small: int = 1, large: int = 256, repeats: int = 21) -> dict[str, Any]:
        """The live DRAM restore path's constants on this node, for the model (``--measure``):
        end-to-end restores of a ``small``- and a ``large``-page DRAM session, alternated so
        load hits both alike, their medians fitted as a fixed cost per restore plus a rate
        (as ``--measure`` fits O_DIRECT commands); no rate when noise hides the slope. Run
        after the replay: its pages would otherwise change the store the trace met."""
        node_id = self.client.nodes.local_node_id
        short_chat = PutHints(turn=2, prior_reply_tokens=1, context_tokens=1)  # a DRAM rule
        sessions, media = [], []
        for count in (small, large):
            keys = [f"calibrate-{node_id}-{count}-{i}" for i in range(count)]
            kv = page_bytes_for(np.arange(count), self.layers, self.page_bytes)
            session = f"calibrate-{node_id}-{count}"
            result = self.client.put(keys, kv, session_id=session, hints=short_chat)
            media.append(None if result.medium is None else result.medium.name)
            sessions.append((keys, np.zeros_like(kv)))
            self.client.restore_report(keys, sessions[-1][1])  # pays for the first lookup
        runs: list[list[float]] = [[], []]
        for _ in range(repeats):
            for index, (keys, out) in enumerate(sessions):
                started = time.perf_counter()
                self.client.restore_report(keys, out)
                runs[index].append(time.perf_counter() - started)
        low, high = (float(np.median(r)) for r in runs)
        page_all = self.layers * self.page_bytes
        per_byte = (high - low) / ((large - small) * page_all)
        found: dict[str, Any] = {"media": media, "seconds": {small: low, large: high}}
        found["restore_overhead_ms"] = max(0.0, low - small * page_all * max(per_byte, 0)) * 1e3
        if per_byte > 0:
            found["h2d_gb_s"] = 1 / per_byte / 1e9
        return found

    def run(
        self, requests: list[int], arrivals: list[float], start_at: float
    ) -> list[dict[str, Any]]:
        """Replay ``requests`` (trace indices, in order) arriving at ``arrivals`` seconds after
        ``start_at`` (a wall-clock time every node shares); one record per request."""
        self.start_at = start_at
        return [self._one(r, a) for r, a in zip(requests, arrivals, strict=True)]

    def _one(self, request: int, arrival: float) -> dict[str, Any]:
        pages = self.pages
        lag = self.start_at + arrival - time.time()
        if lag > 0:
            time.sleep(lag)
        began = time.time()
        keys = pages.keys[pages.offsets[request] : pages.offsets[request + 1]]
        record: dict[str, Any] = {"request": request, "pages": len(keys)}
        record["queued_s"] = max(0.0, began - self.start_at - arrival)
        if not len(keys):
            return record
        key_list = keys.tolist()
        started = time.perf_counter()
        report = self.client.restore_report(key_list, self.out)
        record["restore_s"] = time.perf_counter() - started
        record.update(_report_fields(report, self.layers))
        kv = page_bytes_for(keys, self.layers, self.page_bytes)
        hit = report.pages
        record["byte_exact"] = bool(np.array_equal(self.out[:, :hit], kv[:, :hit]))
        started = time.perf_counter()
        result = self.client.put(
            key_list, kv, session_id=pages.session_of(request), hints=put_hints(pages, request)
        )
        record["put_s"] = time.perf_counter() - started
        record["put_medium"] = None if result.medium is None else result.medium.name
        return record


def _report_fields(report: Any, layers: int) -> dict[str, Any]:
    """Hit pages, bytes read, read commands and data seconds by medium; remote paths apart.
    (A path's tally counts a page once a layer.)"""
    fields: dict[str, Any] = {
        "hit_pages": report.pages,
        "control_s": report.control_seconds,
        "data_s": report.data_seconds,
        "actor_calls": report.actor_calls,
        "remote_pages": 0,
        "failures": len(report.failures),
    }
    for medium in ("dram", "ssd"):
        for name in ("pages", "bytes", "commands", "seconds"):
            fields[f"{medium}_{name}"] = 0
    for path, tally in report.paths.items():
        medium = medium_of_path(path)
        fields[f"{medium}_pages"] += tally.pages // layers
        fields[f"{medium}_bytes"] += tally.bytes
        fields[f"{medium}_commands"] += tally.io_commands
        fields[f"{medium}_seconds"] += tally.seconds
        if path.startswith("remote") or "fallback" in path:
            fields["remote_pages"] += tally.pages // layers
    return fields
