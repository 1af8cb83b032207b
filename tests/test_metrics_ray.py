"""The service's metrics as Prometheus sees them: Ray's metrics agent, scraped over 127.0.0.1.

A local Ray with a metrics export port runs the service; a client in this process puts on
both media, restores both, misses in another tenant and probes. The agent's endpoint must
then show exactly those figures (requests counted once, by the client that made them, not
again by the node that served them), and ``flatcake-ray status`` must show them per node and
per tenant. Ray exports at an interval: the test polls, within a bound.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import time

import numpy as np
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

from flatcake_ray.cli import main  # noqa: E402
from flatcake_ray.client import tenants  # noqa: E402
from flatcake_ray.client.client import FlatCakeClient  # noqa: E402
from flatcake_ray.config import ClientConfig  # noqa: E402
from flatcake_ray.core.catalog import PutHints  # noqa: E402
from flatcake_ray.core.gva import Medium  # noqa: E402
from flatcake_ray.metrics.definitions import BY_NAME  # noqa: E402
from flatcake_ray.metrics.prometheus import scrape  # noqa: E402
from flatcake_ray.metrics.view import PREFIX, collapse  # noqa: E402

NAMESPACE = "fc-metrics"
LAYERS, PAGE_BYTES = 4, 8192
PAGE = LAYERS * PAGE_BYTES
DRAM = PutHints(turn=2, prior_reply_tokens=1)  # short chat -> DRAM
SSD = PutHints(turn=1)  # one-shot -> SSD
EXPORT_BOUND_S = 90.0  # Ray exports every second here; a loaded machine is slower

if importlib.util.find_spec("aiohttp") is None or importlib.util.find_spec("grpc") is None:
    pytest.skip("Ray's metrics agent needs ray[default] (aiohttp, grpc)", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def kv_for(pages: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (LAYERS, pages, PAGE_BYTES), np.uint8)


def keys(name: str, pages: int) -> list[str]:
    return [f"{name}/{i}" for i in range(pages)]


@pytest.fixture(scope="module")
def service(ray_service):
    port = free_port()
    system = {"metrics_report_interval_ms": 1000, "agent_register_timeout_ms": 120_000}
    ray_service(
        NAMESPACE,
        local={
            "_node_ip_address": "127.0.0.1",
            "_metrics_export_port": port,
            "_system_config": system,
        },
        layers=LAYERS,
        page_bytes=PAGE_BYTES,
        dram_bytes=16 << 20,
        ssd_file_bytes=16 << 20,
        ship_bytes=8 << 20,
        landing_bytes=4 << 20,
        rpc_timeout_s=30.0,
        report_interval_s=0.5,
    )
    clients = {
        name: FlatCakeClient(NAMESPACE, config=ClientConfig(tenant_secret=secret))
        for name in ("a", "b")
        for secret in [tenants.add_tenant(NAMESPACE, name, layers=LAYERS, page_bytes=PAGE_BYTES)]
    }
    yield clients, f"http://127.0.0.1:{port}/metrics"
    for client in clients.values():
        client.close()


@pytest.fixture(scope="module")
def workload(service):
    """Both media in tenant a, restored; tenant b asks for a's keys and misses (they are not
    b's); a probe. Returns what to expect."""
    clients, url = service
    client = clients["a"]
    dram = client.put(keys("d", 3), kv_for(3, 1), session_id="d", hints=DRAM)
    ssd = client.put(keys("s", 5), kv_for(5, 2), session_id="s", hints=SSD)
    assert (dram.medium, ssd.medium) == (Medium.DRAM, Medium.SSD)
    out = np.zeros((LAYERS, 5, PAGE_BYTES), dtype=np.uint8)
    from_dram = client.restore_report(keys("d", 3), out[:, :3])
    from_ssd = client.restore_report(keys("s", 5), out)
    missed = clients["b"].restore_report(keys("d", 2), out[:, :2])  # a's keys: not b's
    assert (from_dram.pages, from_ssd.pages, missed.pages) == (3, 5, 0)
    assert np.array_equal(out, kv_for(5, 2))
    assert client.probe([*keys("s", 5), "x"]).hits == 5
    node = str(from_ssd.node_id)
    ssd_path = from_ssd.paths["local-ssd"]
    a, b = {"node_id": node, "tenant": "a"}, {"node_id": "none", "tenant": "b"}
    expected = [
        ("flatcake_lookups", a, 2),
        ("flatcake_lookup_pages", a, 8),
        ("flatcake_lookups", b, 1),
        ("flatcake_lookup_pages", b, 2),
        ("flatcake_hit_pages", {**a, "medium": "dram"}, 3),
        ("flatcake_hit_pages", {**a, "medium": "ssd"}, 5),
        ("flatcake_delivered_bytes", {**a, "medium": "dram"}, 3 * PAGE),
        ("flatcake_delivered_bytes", {**a, "medium": "ssd"}, 5 * PAGE),
        ("flatcake_read_bytes", {**a, "medium": "dram", "path": "local-dram"}, 3 * PAGE),
        ("flatcake_read_bytes", {**a, "medium": "ssd", "path": "local-ssd"}, ssd_path.bytes),
        ("flatcake_ssd_read_commands", {**a, "path": "local-ssd"}, ssd_path.io_commands),
        ("flatcake_probes", a, 1),
        ("flatcake_probe_pages", a, 6),
        ("flatcake_probe_hit_pages", a, 5),
        ("flatcake_puts", {**a, "medium": "dram", "path": "arena"}, 1),
        ("flatcake_puts", {**a, "medium": "ssd", "path": "landing"}, 1),
        ("flatcake_written_bytes", {**a, "medium": "ssd", "path": "landing"}, 5 * PAGE),
        ("flatcake_tenant_used_bytes", {**a, "medium": "dram"}, 3 * PAGE),
        ("flatcake_tenant_used_bytes", {**a, "medium": "ssd"}, 5 * PAGE),
        ("flatcake_scopes", {"node_id": node, "medium": "dram"}, 1),
        ("flatcake_scopes", {"node_id": node, "medium": "ssd"}, 1),
        ("flatcake_node_up", {"node_id": node}, 1),
        ("flatcake_node_restarts", {"node_id": node}, 0),
    ]
    counts = [
        ({**a, "path": "local-dram"}, 1),
        ({**a, "path": "local-ssd"}, 1),
    ]
    return url, node, expected, counts, ssd_path


def _scraped(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = collapse(scrape(url, 5.0, PREFIX))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}


def _wanted(expected, counts) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    wanted = {
        (BY_NAME[name].exported, tuple(sorted(labels.items()))): float(value)
        for name, labels, value in expected
    }
    for labels, value in counts:
        series = BY_NAME["flatcake_restore_seconds"].exported + "_count"
        wanted[series, tuple(sorted(labels.items()))] = float(value)
    return wanted


def test_the_metrics_endpoint_shows_exactly_what_the_workload_did(workload):
    url, _, expected, counts, _ = workload
    wanted = _wanted(expected, counts)
    started = time.monotonic()
    while True:
        seen = _scraped(url)
        differ = {k: (seen.get(k), v) for k, v in wanted.items() if seen.get(k) != v}
        if not differ or time.monotonic() - started > EXPORT_BOUND_S:
            break
        time.sleep(1.0)
    assert not differ, f"(scraped, expected) after {time.monotonic() - started:.0f} s: {differ}"
    names = {name for name, _ in seen}
    assert BY_NAME["flatcake_restore_seconds"].exported + "_bucket" in names
    time.sleep(2.5)  # more exports and capacity reports: nothing is counted twice
    assert all(_scraped(url).get(k) == v for k, v in wanted.items())


def test_status_shows_each_node_and_tenant(workload, capsys):
    url, node, expected, counts, _ = workload
    wanted = _wanted(expected, counts)
    deadline = time.monotonic() + EXPORT_BOUND_S
    while any(_scraped(url).get(k) != v for k, v in wanted.items()):
        assert time.monotonic() < deadline, "the workload's metrics never arrived"
        time.sleep(1.0)
    assert main(["status", "--json", "--namespace", NAMESPACE]) == 0
    info = json.loads(capsys.readouterr().out)
    metrics = info["metrics"]
    assert metrics["errors"] == [] and metrics["endpoints"] == [url]
    row = next(r for r in metrics["nodes"] if r["node_id"] == node)
    assert row["hit_rate"] == {"dram": 3 / 8, "ssd": 5 / 8}
    assert row["restores"] == 2 and row["restore_p50_ms"] > 0
    assert (row["restarts"], row["quarantined_scopes"]) == (0, 0)
    assert row["used_bytes"]["dram"] == info["nodes"][0]["dram_used"] > 0
    tenant_a = next(r for r in metrics["tenants"] if (r["tenant"], r["node_id"]) == ("a", node))
    assert tenant_a["used_bytes"] == {"dram": 3 * PAGE, "ssd": 5 * PAGE}
    assert tenant_a["probe_hit_rate"] == 5 / 6
    tenant_b = next(r for r in metrics["tenants"] if (r["tenant"], r["node_id"]) == ("b", "all"))
    assert (tenant_b["lookups"], tenant_b["hit_rate"]["ssd"]) == (1, 0.0)
    assert main(["status", "--namespace", NAMESPACE]) == 0
    text = capsys.readouterr().out
    assert "metrics per tenant" in text
    assert any(line.split()[:2] == ["a", node] for line in text.splitlines())


def test_a_restarted_node_shows_its_restart_and_lost_dram(service, workload, capsys):
    """Runs last: kills the storage node; Ray restarts it, and the endpoint and status show
    one restart and the one DRAM scope (tenant a's) that the death lost."""
    clients, _ = service
    url, node, *_ = workload
    actor_name = clients["a"].nodes.require(int(node)).description.actor_name
    ray.kill(ray.get_actor(actor_name, namespace=NAMESPACE), no_restart=False)
    wanted = {
        (BY_NAME["flatcake_node_restarts"].exported, (("node_id", node),)): 1.0,
        (BY_NAME["flatcake_lost_scopes"].exported, (("medium", "dram"), ("node_id", node))): 1.0,
    }
    deadline = time.monotonic() + EXPORT_BOUND_S
    while any(_scraped(url).get(k) != v for k, v in wanted.items()):
        assert time.monotonic() < deadline, f"no restart seen: {_scraped(url)}"
        time.sleep(1.0)
    assert main(["status", "--json", "--namespace", NAMESPACE]) == 0
    row = next(
        r for r in json.loads(capsys.readouterr().out)["metrics"]["nodes"] if r["node_id"] == node
    )
    assert (row["restarts"], row["lost_dram_scopes"]) == (1, 1)
