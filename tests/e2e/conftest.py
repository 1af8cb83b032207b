"""End-to-end tests: real engines run a tiny random-weight Llama on CPU with FlatCake-Ray under
them. They need the ``.venv-e2e`` venv (``make test-e2e``) and skip with the reason elsewhere.

Every module checks, when it ends, that no shared-memory segment its processes mapped is
left in /dev/shm (vLLM's queues, Serve's, the stores' arenas), and removes any it finds.
"""

from __future__ import annotations

import os

# vLLM and Ray read these at import or start.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # never fork a Ray driver
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
# Serve kills a proxy not ready within 5 s of starting (and one whose health check takes
# 10 s): on a busy 2-core machine a proxy's worker takes longer to start, and serve.start
# then failed with the proxy killed. The clusters started below inherit these; they bound
# only a failure.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "120")

import contextlib
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.e2e.shm import ShmTracker
from tests.e2e.tiny_model import write_tiny_llama

# Warnings raised inside the engines, torch and Ray, never by our code. pytest turns
# warnings into errors (pyproject), so each is let through by its exact text.
ENGINE_WARNINGS = (
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
    # torch 2.13 deprecates torch.distributed.reduce_op, which vLLM's CPU path still touches
    "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning",
    # vLLM's engine-core client leaves its zmq context to the garbage collector
    "ignore:Unclosed context:ResourceWarning",
    # Ray Serve 2.60 declares pydantic fields the v1 way
    "ignore:Using extra keyword arguments on `Field` is deprecated:DeprecationWarning",
    "ignore:Exception ignored in. <function Context.__del__"
    ":pytest.PytestUnraisableExceptionWarning",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in ENGINE_WARNINGS:
        config.addinivalue_line("filterwarnings", line)


def require_vllm() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test-e2e builds .venv-e2e)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


# The service cluster (``ray_service``) lives across the modules that use it; set while it runs.
_CLUSTER_SHM: list[ShmTracker] = []
RAY_SERVICE_NAMESPACE = "fc-e2e"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that use the shared Ray service run last, back to back, so the cluster
    (started by the first of them) is shut down at the end of the session, right after the
    last one, and never idles beside the other engines."""
    items.sort(key=lambda item: "ray_service" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="module", autouse=True)
def shm_left_clean():
    """Removes every shared-memory segment the module's processes mapped and left behind.

    FlatCake's own segments (arenas, staging) left behind fail the module: releasing them is
    the connector's job. The engines' (vLLM's message queues, which its engine core and
    workers unlink only when they exit cleanly) are removed and listed in the output. Segments
    of the shared service cluster, still running, are checked when it stops (``ray_service``).
    """
    tracker = ShmTracker(period=1.0)
    yield tracker
    tracker.stop()
    in_use = _CLUSTER_SHM[0].snapshot() if _CLUSTER_SHM else set()
    remove_leftovers(tracker.leftovers(ignore=in_use))


def remove_leftovers(left: list[str]) -> None:
    for path in left:
        Path(path).unlink(missing_ok=True)
    ours = [path for path in left if os.path.basename(path).startswith("flatcake-")]
    if left:
        print(f"\nremoved shared memory the engines left in /dev/shm: {left}")
    assert not ours, f"FlatCake left shared memory in /dev/shm: {ours}"


@pytest.fixture(scope="module")
def one_process_engines():
    """vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with the uni
    executor: the scheduler, the worker and the store share this process."""
    import vllm.envs

    patch = pytest.MonkeyPatch()
    patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm.envs.disable_envs_cache()
    yield {"distributed_executor_backend": "uni"}
    patch.undo()
    vllm.envs.disable_envs_cache()


@pytest.fixture(scope="session")
def ray_service(tmp_path_factory):
    """One local 2-node Ray cluster with the FlatCake service on it, for every module that
    needs one (cross-node vLLM, Ray Serve LLM): a cluster and a service start once."""
    tracker = ShmTracker(period=1.0)
    _CLUSTER_SHM.append(tracker)
    try:
        root = tmp_path_factory.mktemp("svc")
        with two_node_cluster(root, RAY_SERVICE_NAMESPACE) as info:
            yield info
    finally:
        _CLUSTER_SHM.clear()
        tracker.stop()
    remove_leftovers(tracker.leftovers())


def store_options(root: Path, **overrides: object) -> dict[str, object]:
    """An in-process store on real files under ``root``, small enough for the tiny model."""
    options: dict[str, object] = {
        "store": "local",
        "store_root": str(root),
        "store_dram_bytes": "8MiB",
        "store_ssd_file_bytes": "16MiB",
        "store_ssd_files_per_dir": 2,
        "store_ssd_min_run_bytes": "256KiB",
        "store_fsync": False,
    }
    options.update(overrides)
    return options


@contextlib.contextmanager
def two_node_cluster(root: Path, namespace: str, *, service_on_head_only: bool = True):
    """A local 2-node Ray cluster (all on 127.0.0.1) with the FlatCake service started on it.

    Each node has its own Ray temp folder: an engine process that descends from a Ray worker
    joins its own node through it (``_ray_connect``), not the head every driver on this
    machine would otherwise join. The folders are short (Ray's socket paths are limited).
    """
    import ray

    from flatcake_ray.client import deploy

    temp = Path(tempfile.mkdtemp(prefix="fce2e-", dir="/tmp"))
    head_args = {"num_cpus": 2, "include_dashboard": False, "temp_dir": str(temp / "h")}
    cluster = _start_head(head_args)
    try:
        worker = cluster.add_node(num_cpus=2, temp_dir=str(temp / "w"))
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
        head_id = ray.get_runtime_context().get_node_id()
        config = service_config(root, namespace)
        nodes = [head_id] if service_on_head_only else None
        deploy.start(config, address=cluster.address, nodes=nodes)
        yield {
            "cluster": cluster,
            "address": cluster.address,
            "head": head_id,
            "worker": worker.node_id,
            "config": config,
        }
        deploy.stop(namespace)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _start_head(head_args: dict, attempts: int = 3):
    """Ray gives a raylet 30 s (fixed) to register with the GCS; on this shared 2-core
    machine a head started under load can miss that, so it gets another try."""
    from ray.cluster_utils import Cluster

    for attempt in range(attempts):
        try:
            return Cluster(initialize_head=True, head_node_args=head_args)
        except Exception as exc:  # Ray raises a bare Exception for this timeout
            if "timed out during startup" not in str(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def service_config(root: Path, namespace: str, shape=None, store_bytes: int = 16 << 20):
    """The service for ``shape`` (default: the tiny model), ``store_bytes`` of DRAM and per
    SSD file on each node."""
    from flatcake_ray.config import ServiceConfig
    from tests.e2e.tiny_model import TINY

    shape = shape or TINY
    return ServiceConfig(
        namespace=namespace,
        root=str(root / "{node}"),
        layers=shape.layers,
        page_bytes=shape.page_bytes(32),  # one vLLM block of one layer, bf16
        dram_bytes=store_bytes,
        ssd_file_bytes=store_bytes,
        ssd_files_per_dir=2,
        fsync=False,
        ship_bytes=4 << 20,
        ramp_seconds=0.0,
    )
