"""Shared fixtures. Every test's traffic stays on 127.0.0.1."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Services the tests start (their nodes inherit it) home SSD pages on SSD and read them there:
# the SSD paths are what these tests check. DRAM read replicas (the default policy) are tested
# on their own, in process (test_replicas.py, test_replay_live.py).
os.environ.setdefault("FLATCAKE_DRAM_POLICY", "table2")

import numpy as np
import pytest

from flatcake_ray import failpoints as failpoints_module
from flatcake_ray.config import PlacementConfig, StoreConfig
from flatcake_ray.node.store import FlatCakeStore

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


def random_kv(pages: int, seed: int = 0, layers: int = LAYERS, page_bytes: int = PAGE_BYTES):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(layers, pages, page_bytes), dtype=np.uint8)


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
