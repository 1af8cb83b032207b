"""The live store places a trace as the replay model does.

The model's catalog calls (plans, publishes, leases, releases, in the model's order) are
recorded while it replays a small trace; the same calls then go through a live
:class:`FlatCakeStore` on real files, with real bytes. Every put must get the same medium,
rule, DRAM replica and address, and every page must read back as written.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import pytest

from flatcake_ray.core.catalog import Catalog
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.gva import encode as encode_gva
from flatcake_ray.node.store import FlatCakeStore
from flatcake_ray.replay import flat_store
from flatcake_ray.replay.engine import Replay
from flatcake_ray.replay.pages import build_pages
from flatcake_ray.replay.systems import get_system
from flatcake_ray.replay.workloads import arrivals_for
from flatcake_ray.traces.records import Trace, TraceRequest, frozen_blocks
from tests.test_replay import PAGE_ALL, PAGE_TOKENS, tiny_profile


class RecordingCatalog(Catalog):
    """The live catalog, logging the calls the model makes on it."""

    log: ClassVar[list[tuple]] = []

    def plan_put(self, digests, **options):
        plan = super().plan_put(digests, **options)
        if plan is not None:
            self.log.append(("plan", digests.copy(), options, plan))
        return plan

    def publish(self, plan):
        self.log.append(("publish", plan))
        return super().publish(plan)

    def abort(self, plan):
        self.log.append(("abort", plan))
        super().abort(plan)

    def lease(self, digests):
        lease = super().lease(digests)
        self.log.append(("lease", digests.copy(), lease))
        return lease

    def release(self, lease):
        self.log.append(("release", lease))
        super().release(lease)


def mixed_trace(sessions: int = 10, turns: int = 4) -> Trace:
    """Sessions that alternate short and long replies (short chat, agentic), some one-shot."""
    requests = []
    for turn in range(1, turns + 1):
        for s in range(sessions):
            if s % 3 == 2 and turn > 1:
                continue  # one-shot sessions
            blocks = [s * 1000 + b for b in range(3 + 3 * turn)]
            output = 5000 if (s + turn) % 2 else 8
            requests.append(
                TraceRequest(
                    turn * 2.0 + s * 0.05,
                    f"s{s}",
                    turn,
                    frozen_blocks(blocks),
                    len(blocks) * PAGE_TOKENS,
                    output,
                    PAGE_TOKENS,
                )
            )
    return Trace.from_requests(requests)


def page_bytes_of(keys: np.ndarray, layers: int, page_bytes: int) -> np.ndarray:
    """Deterministic contents per key: [layers, keys, page_bytes] uint8."""
    base = (keys.astype(np.uint64) * np.uint64(2654435761)) % np.uint64(251)
    layer = np.arange(layers, dtype=np.uint64)[:, None, None]
    offset = np.arange(page_bytes, dtype=np.uint64)[None, None, :] % np.uint64(7)
    return ((base[None, :, None] + layer + offset) % np.uint64(256)).astype(np.uint8)


@pytest.fixture
def model_log(monkeypatch):
    RecordingCatalog.log = []
    monkeypatch.setattr(flat_store, "Catalog", RecordingCatalog)
    # DRAM for 10 pages, SSD for 120: replicas are dropped, DRAM homes spill, SSD reclaims.
    profile = tiny_profile(dram_bytes=10 * PAGE_ALL, ssd_bytes=120 * PAGE_ALL)
    pages = build_pages(mixed_trace(), profile.page_tokens)
    engine = Replay(pages, arrivals_for(pages, 4.0, 0), profile, get_system("flatcake"))
    engine.run()
    return engine, RecordingCatalog.log


def test_live_store_makes_the_models_placement_decisions(model_log, tmp_path):
    engine, log = model_log
    model_catalog = engine.storage.catalog
    rules = {entry[3].rule for entry in log if entry[0] == "plan"}
    assert {"one-shot", "short-chat", "agentic"} <= rules  # the trace exercises Table 2
    assert model_catalog.counters["replicas_written"] > 0
    assert model_catalog.counters["replica_scopes_dropped"] > 0
    assert model_catalog.counters["reclaimed_scopes"] > 0

    config = dataclasses.replace(
        model_catalog.config, root=str(tmp_path), fsync=False, hugepages="off"
    )
    with FlatCakeStore(config) as store:
        compared = replay_log_into(store, log, config)
        assert compared == sum(1 for entry in log if entry[0] == "publish") > 0
        assert store.catalog.counters == model_catalog.counters
        assert store.catalog.rule_counts == model_catalog.rule_counts
        check_bytes(store, model_catalog, config)


def replay_log_into(store: FlatCakeStore, log: list[tuple], config) -> int:
    handles, leases, compared = {}, {}, 0
    for entry in log:
        kind = entry[0]
        if kind == "plan":
            _, digests, options, plan = entry
            keys = digests["lo"].tolist()
            handles[id(plan)] = (store.begin_put(keys, **options), digests)
        elif kind in ("publish", "abort"):
            plan = entry[1]
            handle, digests = handles.pop(id(plan))
            if kind == "abort":
                handle.abort()
                continue
            kv = page_bytes_of(digests["lo"], config.layers, config.page_bytes)
            for layer in range(config.layers):
                handle.write_layer(layer, kv[layer])
            replicas = store.stats()["replicas_written"]
            result = handle.commit()
            segment = plan.segment
            assert (result.medium, result.rule) == (segment.medium, plan.rule)
            assert store.stats()["replicas_written"] - replicas == (plan.replica is not None)
            new_keys = digests["lo"][plan.new_positions].tolist()
            where = segment.offset + np.arange(len(new_keys)) * config.page_bytes
            expected = [encode_gva(segment.medium, config.node_id, int(o)) for o in where]
            assert store.gvas(new_keys).tolist() == expected  # the same address, too
            compared += 1
        elif kind == "lease":
            _, digests, lease = entry
            live = store.lease(digests["lo"].tolist())
            assert live.hits == lease.hits
            assert [v.medium for v in live.segments.values()] == [
                v.medium for v in lease.segments.values()
            ]
            leases[lease.lease_id] = live
        else:
            store.release(leases.pop(entry[1].lease_id))
    return compared


def check_bytes(store: FlatCakeStore, catalog: Catalog, config) -> None:
    """Every stored page reads back as written, from its replica or its home."""
    media = set()
    for segment in list(catalog.segments.values()):
        keys = segment.digests["lo"]
        out = np.zeros((config.layers, len(keys), config.page_bytes), dtype=np.uint8)
        assert store.get(keys.tolist(), out) == len(keys)
        np.testing.assert_array_equal(out, page_bytes_of(keys, config.layers, config.page_bytes))
        media.add((segment.replica or segment).medium)
    assert media == {Medium.DRAM, Medium.SSD}
