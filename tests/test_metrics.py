"""Metrics of the in-process store: recorded per request, read back exactly from ``stats()``.

The same series reach Prometheus through Ray when Ray runs (``test_metrics_ray.py``); here no
Ray is involved, so every figure is checked to the byte against what the workload did.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flatcake_ray.core.gva import Medium
from flatcake_ray.core.tenants import Tenant, new_secret, secret_hash
from flatcake_ray.metrics.definitions import (
    BY_NAME,
    LATENCY_BOUNDARIES,
    MEDIUM,
    METRICS,
    NODE_ID,
    PATH,
    TENANT,
    Kind,
    exported_series,
)
from flatcake_ray.metrics.prometheus import Sample, parse
from flatcake_ray.metrics.record import by_medium_and_path
from flatcake_ray.metrics.registry import Batch, Recorder
from flatcake_ray.metrics.view import collapse, quantile, status_view
from flatcake_ray.node.store import PutHints
from tests.conftest import LAYERS, PAGE_BYTES, random_kv

SHORT_CHAT = PutHints(turn=2, prior_reply_tokens=10)  # Table 2: DRAM
PAGE = LAYERS * PAGE_BYTES  # bytes of one page, every layer
PAGE_TOKENS = 256  # PlacementConfig's default


def value(samples, name: str, **labels: str) -> float:
    """The one collapsed sample of ``name`` with exactly these FlatCake labels (0 if none)."""
    series = BY_NAME[name].exported
    found = [s.value for s in collapse(samples) if s.name == series and dict(s.labels) == labels]
    assert len(found) <= 1
    return found[0] if found else 0.0


def histogram_count(samples, name: str, **labels: str) -> float:
    series = BY_NAME[name].exported + "_count"
    return sum(s.value for s in samples if s.name == series and dict(s.labels) == labels)


def restore(store, keys, tenant):
    out = np.zeros((LAYERS, len(keys), PAGE_BYTES), dtype=np.uint8)
    return store.get(keys, out, tenant=tenant), out


def with_tenants(store, *names: str):
    """``store`` with tenants ``names`` registered (the store's geometry, no quotas)."""
    for name in names:
        store.set_tenant(Tenant(name, secret_hash(new_secret()), LAYERS, PAGE_BYTES))
    return store


@pytest.fixture
def workload(make_store):
    """Puts on both media in tenant a, restores of both, a miss in tenant b, one probe."""
    store = with_tenants(make_store(), "a", "b")
    dram_kv, ssd_kv = random_kv(3, seed=1), random_kv(5, seed=2)
    dram_keys, ssd_keys = [f"d{i}" for i in range(3)], [f"s{i}" for i in range(5)]
    assert (
        store.put(dram_keys, dram_kv, tenant="a", session_id="d", hints=SHORT_CHAT).medium
        is Medium.DRAM
    )
    assert store.put(ssd_keys, ssd_kv, tenant="a", session_id="s").medium is Medium.SSD
    before = dict(store.counters)
    assert restore(store, dram_keys, "a")[0] == 3
    assert restore(store, ssd_keys, "a")[0] == 5
    assert restore(store, ["m0", "m1"], "b")[0] == 0
    assert store.probe([*ssd_keys, "x"], tenant="a").hits == 5
    stats = store.stats()
    read = {k: stats[k] - before[k] for k in ("ssd_bytes_read", "ssd_read_commands")}
    return store, stats, read


def test_every_metric_is_well_formed():
    names = [series for metric in METRICS for series in metric.series()]
    assert len(names) == len(set(names)) == len(exported_series())
    for metric in METRICS:
        assert set(metric.tags) <= {NODE_ID, TENANT, MEDIUM, PATH}
        assert metric.exported.startswith("ray_flatcake_")
        assert metric.exported.endswith("_total") == (metric.kind is Kind.COUNTER)
        if metric.kind is Kind.HISTOGRAM:
            assert list(metric.boundaries) == sorted(set(metric.boundaries))
            assert metric.boundaries[0] > 0
        else:
            assert metric.boundaries == ()


def test_restores_and_probes_are_counted_once_each_by_medium_and_path(workload):
    _, stats, read = workload
    samples = [Sample(s["name"], s["labels"], s["value"]) for s in stats["metrics"]]
    a, miss = {NODE_ID: "0", TENANT: "a"}, {NODE_ID: "none", TENANT: "b"}
    assert value(samples, "flatcake_lookups", **a) == 2
    assert value(samples, "flatcake_lookup_pages", **a) == 8
    assert value(samples, "flatcake_lookup_tokens", **a) == 8 * PAGE_TOKENS
    assert value(samples, "flatcake_lookups", **miss) == 1
    assert value(samples, "flatcake_lookup_pages", **miss) == 2
    assert value(samples, "flatcake_hit_pages", **a, medium="dram") == 3
    assert value(samples, "flatcake_hit_pages", **a, medium="ssd") == 5
    assert value(samples, "flatcake_hit_tokens", **a, medium="ssd") == 5 * PAGE_TOKENS
    assert value(samples, "flatcake_delivered_bytes", **a, medium="dram") == 3 * PAGE
    assert value(samples, "flatcake_delivered_bytes", **a, medium="ssd") == 5 * PAGE
    ssd_read = value(samples, "flatcake_read_bytes", **a, medium="ssd", path="local-ssd")
    assert ssd_read == read["ssd_bytes_read"] >= 5 * PAGE  # whole blocks, aligned
    assert value(samples, "flatcake_read_bytes", **a, medium="dram", path="local-dram") == 3 * PAGE
    commands = value(samples, "flatcake_ssd_read_commands", **a, path="local-ssd")
    assert commands == read["ssd_read_commands"] > 0
    for path in ("local-dram", "local-ssd"):
        assert histogram_count(samples, "flatcake_restore_seconds", **a, path=path) == 1
        assert histogram_count(samples, "flatcake_restore_queue_seconds", **a, path=path) == 1
    assert not [s for s in samples if "restore" in s.name and s.labels.get(TENANT) == "b"]
    assert value(samples, "flatcake_probes", **a) == 1
    assert value(samples, "flatcake_probe_pages", **a) == 6
    assert value(samples, "flatcake_probe_hit_pages", **a) == 5


def test_puts_and_node_state(workload):
    store, stats, _ = workload
    samples = store.metrics.samples()
    for medium, pages in (("dram", 3), ("ssd", 5)):
        tags = {NODE_ID: "0", TENANT: "a", MEDIUM: medium, PATH: "in-process"}
        assert value(samples, "flatcake_puts", **tags) == 1
        assert value(samples, "flatcake_written_pages", **tags) == pages
        assert value(samples, "flatcake_written_bytes", **tags) == pages * PAGE
        used = value(samples, "flatcake_tenant_used_bytes", node_id="0", tenant="a", medium=medium)
        assert used == pages * PAGE
        assert value(samples, "flatcake_scopes", node_id="0", medium=medium) == 1
    used_dram = value(samples, "flatcake_media_used_bytes", node_id="0", medium="dram")
    assert used_dram == stats["dram_used"] > 0
    assert (
        value(samples, "flatcake_media_used_bytes", node_id="0", medium="ssd")
        == (stats["ssd_reserved"])
    )
    assert value(samples, "flatcake_pages", node_id="0") == stats["pages_indexed"] == 8
    assert value(samples, "flatcake_index_bytes", node_id="0") == stats["index_bytes"]
    assert value(samples, "flatcake_ssd_prewrite_pending_bytes", node_id="0") == 0  # off
    assert value(samples, "flatcake_node_up", node_id="0") == 1


def test_status_view_of_a_store(workload):
    store, _, _ = workload
    view = status_view(store.metrics.samples())
    node = next(r for r in view["nodes"] if r[NODE_ID] == "0")
    assert node["hit_rate"] == {"dram": 3 / 8, "ssd": 5 / 8}
    assert node["restores"] == 2 and 0 < node["restore_p50_ms"] <= node["restore_p99_ms"]
    assert node["used_bytes"]["dram"] > 0 and node["restarts"] == 0
    nowhere = next(r for r in view["nodes"] if r[NODE_ID] == "none")
    assert (nowhere["lookups"], nowhere["restores"]) == (1, 0)
    tenant_b = next(r for r in view["tenants"] if r[TENANT] == "b" and r[NODE_ID] == "all")
    assert tenant_b["hit_rate"] == {"dram": 0.0, "ssd": 0.0}
    tenant_a = next(r for r in view["tenants"] if r[TENANT] == "a" and r[NODE_ID] == "0")
    assert tenant_a["used_bytes"] == {"dram": 3 * PAGE, "ssd": 5 * PAGE}
    assert tenant_a["probe_hit_rate"] == 5 / 6


def test_quarantine_and_reclamation_are_counted(make_store):
    store = with_tenants(make_store(), "q")
    store.put(list(range(4)), random_kv(4, seed=7), tenant="q")
    store.stats()
    tenant_q = {"node_id": "0", "tenant": "q", "medium": "ssd"}
    assert value(store.metrics.samples(), "flatcake_tenant_used_bytes", **tenant_q) == 4 * PAGE
    file_index, offset = store.pool.locate(int(store.gvas([2], tenant="q")[0]) & ((1 << 48) - 1))
    with open(store.pool.paths[file_index], "r+b") as pool_file:
        pool_file.seek(offset + 100)
        byte = pool_file.read(1)
        pool_file.seek(offset + 100)
        pool_file.write(bytes([byte[0] ^ 0xFF]))
    assert restore(store, list(range(4)), "q")[0] == 0
    stats = store.stats()
    samples = store.metrics.samples()
    assert value(samples, "flatcake_quarantined_scopes", node_id="0") == 1
    assert value(samples, "flatcake_scopes", node_id="0", medium="ssd") == 0
    # quarantined space is never handed out again, so it stays charged to its tenant
    charged = stats["tenants"]["q"]["ssd_used"]
    assert value(samples, "flatcake_tenant_used_bytes", **tenant_q) == charged
    store.stats()  # a second report adds nothing: counters move by what changed
    assert value(store.metrics.samples(), "flatcake_quarantined_scopes", node_id="0") == 1


def test_reclaimed_scopes_are_counted(make_store):
    store = make_store(dram_bytes=256 << 10)
    kv = random_kv(4, seed=3)
    for i in range(8):
        store.put([f"r{i}-{p}" for p in range(4)], kv, session_id=f"r{i}", hints=SHORT_CHAT)
    stats = store.stats()
    assert stats["reclaimed_scopes"] > 0
    samples = store.metrics.samples()
    assert value(samples, "flatcake_reclaimed_scopes", node_id="0") == stats["reclaimed_scopes"]
    assert value(samples, "flatcake_reclaimed_bytes", node_id="0") == stats["reclaimed_bytes"]
    live = value(
        samples, "flatcake_tenant_used_bytes", node_id="0", tenant="default", medium="dram"
    )
    assert live == stats["scopes"] * 4 * PAGE  # only the scopes still live


def test_fallback_bytes_are_split_by_medium():
    split = by_medium_and_path(
        {"local-dram": 100, "object-store-fallback": 700}, {Medium.SSD: 500, Medium.DRAM: 200}
    )
    assert split == {
        (Medium.DRAM, "local-dram"): 100,
        (Medium.DRAM, "object-store-fallback"): 200 - 100,
        (Medium.SSD, "object-store-fallback"): 500,
    }


@given(st.lists(st.floats(min_value=0, max_value=20, allow_nan=False), max_size=60))
def test_histogram_buckets_count_values_at_or_below_each_bound(values):
    recorder = Recorder()
    batch = Batch()
    for v in values:
        batch.observe("flatcake_restore_seconds", ("1", "t", "local-ssd"), v)
    recorder.apply(batch)
    buckets = {
        float(s.labels["le"]): s.value for s in recorder.samples() if s.name.endswith("_bucket")
    }
    for bound in LATENCY_BOUNDARIES:
        assert buckets.get(bound, 0) == sum(v <= bound for v in values)
    assert buckets.get(math.inf, 0) == len(values)


def test_quantile_interpolates_within_a_bucket():
    assert quantile(0.5, {1.0: 0, 2.0: 10, math.inf: 10}) == 1.5
    assert quantile(0.99, {1.0: 5, math.inf: 10}) == 1.0  # beyond the last bound
    assert quantile(0.5, {1.0: 0, math.inf: 0}) is None


label_text = st.text(alphabet=st.sampled_from('ab"\\\n x=,{}'), max_size=12)


@given(
    st.dictionaries(st.sampled_from(["node_id", "tenant", "path"]), label_text),
    st.floats(min_value=-1e12, max_value=1e12, allow_nan=False),
)
def test_exposition_labels_round_trip(labels, number):
    escaped = {
        k: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        for k, v in labels.items()
    }
    body = ",".join(f'{k}="{v}"' for k, v in escaped.items())
    text = f"# HELP ray_x help\nray_x{{{body}}} {number!r}\nother_y 1\n"
    assert parse(text, "ray_") == [Sample("ray_x", labels, number)]


def test_the_in_process_store_records_without_importing_ray(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        from flatcake_ray.node.store import FlatCakeStore
        from tests.conftest import small_config, random_kv
        with FlatCakeStore(small_config({str(tmp_path)!r})) as store:
            store.put(["k"], random_kv(1))
            store.get(["k"], np.zeros((4, 1, 8192), dtype=np.uint8))
            assert any(s["name"] == "ray_flatcake_lookups_total" for s in store.stats()["metrics"])
        assert "ray" not in sys.modules, "the store imported ray"
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
