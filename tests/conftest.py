"""Shared fixtures. Every test's traffic stays on 127.0.0.1."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray starts its workers (the service's actors, engine actors) at nice 15: on a machine whose
# cores another job keeps busy at nice 0 they got about 3% of a core, and a busy run took
# 40 min in e2e alone with calls timing out. The test clusters run them at nice 0, as
# their driver runs (tests/e2e loads this file first, so its clusters too).
os.environ.setdefault("RAY_worker_niceness", "0")
# Services the tests start (their nodes inherit it) home SSD pages on SSD and read them there:
# the SSD paths are what these tests check. DRAM read replicas (the default policy) are tested
# on their own, in process (test_replicas.py, test_replay_live.py).
os.environ.setdefault("FLATCAKE_DRAM_POLICY", "table2")

import numpy as np
import pytest
from hypothesis import settings

from flatcake_ray import failpoints as failpoints_module
from flatcake_ray.cli.benchkit import QUIET_HEAD, QUIET_NODE
from flatcake_ray.config import PlacementConfig, StoreConfig
from flatcake_ray.node.store import FlatCakeStore

# Hypothesis draws the same examples on every run (derandomize): `make test` on a fresh clone
# must not fail on a draw no earlier run made. `pytest --hypothesis-profile=explore` draws new
# ones (how the coalescing and config-reading bugs of 7 Dec were found); pin what it finds
# with @example.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("fixed")

# Services the tests start keep their secrets here, not in the home folder.
_SECRETS = tempfile.mkdtemp(prefix="flatcake-test-secrets-")
atexit.register(shutil.rmtree, _SECRETS, True)
os.environ.setdefault("FLATCAKE_SECRET_FILE", os.path.join(_SECRETS, "{namespace}.secret"))

LAYERS = 4
PAGE_BYTES = 8192


def small_config(root, **overrides) -> StoreConfig:
    base = dict(
        root=str(root),
        layers=LAYERS,
        page_bytes=PAGE_BYTES,
        dram_bytes=4 << 20,
        ssd_file_bytes=8 << 20,
        ssd_files_per_dir=2,
        ssd_min_run_bytes=256 << 10,
        fsync=False,
        # These stores test the SSD paths, so SSD-homed pages are read from SSD: no DRAM
        # read replicas unless a test asks for them (tests/test_replicas.py does).
        placement=PlacementConfig(dram_policy="table2"),
    )
    base.update(overrides)
    return StoreConfig(**base)


@pytest.fixture(params=[True, False], ids=["avx2-pass", "plain-pass"])
def native_pass(request):
    """The native copies' AVX2 pass (hash in the copy loop, non-temporal stores, copies into
    pieces) where the CPU has it, and the plain pass (copy, then libxxhash) that other CPUs
    take."""
    from flatcake_ray.cuda_ext import host_copy

    module = host_copy.native_module()
    if module is None:
        pytest.skip("cuda_ext/_copyhash.c not built (FLATCAKE_NATIVE=0, or no compiler)")
    before = module.use_avx2(request.param)
    yield request.param
    module.use_avx2(before)


@pytest.fixture
def failpoints():
    """The failpoint module, every point disarmed again when the test ends."""
    failpoints_module.disarm_all()
    yield failpoints_module
    failpoints_module.disarm_all()


@pytest.fixture
def make_store(tmp_path):
    """Build stores on real files under tmp_path; all are closed at the end."""
    stores: list[FlatCakeStore] = []

    def build(**overrides) -> FlatCakeStore:
        store = FlatCakeStore(small_config(tmp_path, **overrides))
        stores.append(store)
        return store

    yield build
    for store in stores:
        store.close()


@pytest.fixture
def pipelines():
    """``pipelines(store, **options)``: a restore pipeline over ``store``'s source, closed at
    the test's end."""
    from flatcake_ray.restore import RestorePipeline

    made: list[RestorePipeline] = []

    def build(store, **options):
        made.append(RestorePipeline(store.source, **options))
        return made[-1]

    yield build
    for pipeline in made:
        pipeline.close()


def random_kv(pages: int, seed: int = 0, layers: int = LAYERS, page_bytes: int = PAGE_BYTES):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(layers, pages, page_bytes), dtype=np.uint8)


def marked_kv(pages: int, seed: int) -> np.ndarray:
    """Pages whose every 64-byte line is distinct and findable: the seed, then its place."""
    lines = np.arange(LAYERS * pages * PAGE_BYTES // 64, dtype=np.uint64) + (seed << 40)
    return np.repeat(lines, 8).view(np.uint8).reshape(LAYERS, pages, PAGE_BYTES).copy()


def lines_found(kv: np.ndarray, haystack: bytes, samples: int = 64) -> int:
    """How many of ``samples`` 64-byte lines of ``kv``, spread over it, ``haystack`` holds."""
    lines = kv.reshape(-1, 64)
    picked = lines[:: max(1, len(lines) // samples)]
    return sum(haystack.find(line.tobytes()) >= 0 for line in picked)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules marked ``long`` first: ``make test-unit``'s two workers take whole modules in
    collection order, so a long one left for last keeps one worker busy while the other waits."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(autouse=True, scope="module")
def _no_ray_left_attached(request):
    """A unit module whose own teardown failed must not leave this process attached to its
    cluster: every later module would then fail to start its own (``ray.init`` twice). Not
    for the engine suites below this folder, whose session fixtures share one Ray."""
    yield
    import sys

    ray = sys.modules.get("ray")
    unit_module = Path(request.module.__file__).parent == Path(__file__).parent
    if unit_module and ray is not None and ray.is_initialized():
        ray.shutdown()


# ---- the Ray service, started for a test module -----------------------------------------------
HEAD_ARGS = {"num_cpus": 1, "include_dashboard": False, **QUIET_HEAD}
# The small service most modules start (each adds what it tests).
SMALL_SERVICE = {
    "layers": LAYERS,
    "page_bytes": PAGE_BYTES,
    "dram_bytes": 8 << 20,
    "ssd_file_bytes": 8 << 20,
    "ship_bytes": 1 << 20,
}
# Ray's system config that has it declare a removed node dead in ~1.5 s (its default: ~15 s).
QUICK_NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}


@dataclass
class RayService:
    """A service a test module started: its config, its Ray cluster (None: a local
    ``ray.init``), the worker nodes added to it, and the folder its storage nodes' roots are in."""

    config: Any
    root: Path
    cluster: Any = None
    workers: list[Any] = field(default_factory=list)

    @property
    def namespace(self) -> str:
        return str(self.config.namespace)


@pytest.fixture(scope="module")
def ray_service(tmp_path_factory):
    """Start the service on a Ray of its own: ``ray_service(namespace, **config)``.

    The Ray is a ``ray.cluster_utils.Cluster`` (a head, plus ``workers`` nodes made with
    ``worker_args``; ``system``: Ray's system config for it), or, with ``local`` (more
    ``ray.init`` arguments), a plain local Ray. ``env`` is set before Ray starts (its nodes
    inherit it). Config fields not given are the ServiceConfig defaults, but for the root (a
    folder per Ray node under the module's temporary folder), fsync off and two SSD files.
    The module's end stops the service and Ray and removes the roots and DRAM arenas."""
    started: list[tuple[RayService, dict[str, str | None]]] = []

    def start(
        namespace: str,
        *,
        workers: int = 0,
        worker_args: dict[str, Any] | None = None,
        system: dict[str, Any] | None = None,
        local: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        resource: str | None = None,
        **fields: Any,
    ) -> RayService:
        from flatcake_ray.client import deploy

        root = tmp_path_factory.mktemp(namespace)
        saved = {name: os.environ.get(name) for name in env or {}}
        os.environ.update(env or {})
        service = RayService(_service_config(namespace, root, fields), root)
        started.append((service, saved))
        if local is None:
            _start_cluster(service, namespace, workers, worker_args or {}, system)
        else:
            _start_local(namespace, local)
        deploy.start(service.config, resource=resource)
        return service

    yield start
    for service, saved in reversed(started):
        _stop_service(service, saved)


def _service_config(namespace: str, root: Path, fields: dict[str, Any]) -> Any:
    from flatcake_ray.config import ServiceConfig

    base = {"root": os.path.join(str(root), "{node}"), "fsync": False, "ssd_files_per_dir": 2}
    return ServiceConfig(namespace=namespace, **{**base, **fields})


def _start_cluster(
    service: RayService,
    namespace: str,
    workers: int,
    worker_args: dict[str, Any],
    system: dict[str, Any] | None,
) -> None:
    import ray
    from ray.cluster_utils import Cluster

    head = {**HEAD_ARGS, "_system_config": system} if system else HEAD_ARGS
    service.cluster = Cluster(initialize_head=True, head_node_args=head)
    node_args = {"num_cpus": 1, **QUIET_NODE, **worker_args}  # storage-only nodes: num_cpus 0
    service.workers = [service.cluster.add_node(**node_args) for _ in range(workers)]
    if workers:
        service.cluster.wait_for_nodes()
    ray.init(address=service.cluster.address, namespace=namespace, log_to_driver=False)


def _start_local(namespace: str, local: dict[str, Any]) -> None:
    import ray

    options = {"num_cpus": 1, "include_dashboard": False, **local}
    ray.init(address="local", namespace=namespace, log_to_driver=False, **options)


def _stop_service(service: RayService, saved_env: dict[str, str | None]) -> None:
    import ray

    from flatcake_ray.client import deploy

    try:
        if ray.is_initialized():
            deploy.stop(service.namespace)
    finally:
        ray.shutdown()
        if service.cluster is not None:
            service.cluster.shutdown()
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(service.root, ignore_errors=True)


T = TypeVar("T")
WAIT_S = 120.0  # how long a loaded machine may take to restart an actor or lose a node


def wait_for(what: str, check: Callable[[], T], timeout_s: float = WAIT_S) -> T:
    """``check()``'s first true value, asked every 0.5 s (a Ray error counts as not yet: the
    actor may be restarting); fails the test naming ``what`` after ``timeout_s``."""
    from ray.exceptions import RayError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
        except RayError:
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.5)
