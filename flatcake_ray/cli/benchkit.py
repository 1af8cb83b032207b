"""Pieces every service benchmark shares: seeded page data, timing, a local Ray cluster, the
service's bench config, and the physical limits measured beside each path (memcpy, O_DIRECT
sequential read and write). Used by ``flatcake-ray bench restore`` and ``benchmarks/peers``.

Only the public API of the service is used here (``ServiceConfig``); nothing reaches into the
store, the restore engine or the transports, so a rewrite of those leaves this module alone.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from flatcake_ray.config import ServiceConfig

ODIRECT_CHUNK = 32 << 20  # bytes per O_DIRECT command of the sequential limits
ALIGN = 4096


def seeded_pages(layers: int, pages: int, page_bytes: int, seed: int) -> np.ndarray:
    """``[layers, pages, page_bytes]`` uint8 that any process regenerates from ``seed``."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (layers, pages, page_bytes), dtype=np.uint8)


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def best_gbps(nbytes: int, repeats: int, fn: Callable[[], Any]) -> float:
    return nbytes / min(timed(fn, repeats)) / 1e9


def median_gbps(nbytes: int, repeats: int, fn: Callable[[], Any]) -> float:
    return nbytes / statistics.median(timed(fn, repeats)) / 1e9


# ---- physical limits ----------------------------------------------------------------------
def memcpy_gbps(nbytes: int, repeats: int, *, median: bool = False) -> float:
    """One memcpy of ``nbytes`` (numpy copyto, pages touched before timing)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    measure = median_gbps if median else best_gbps
    return measure(nbytes, repeats, lambda: np.copyto(dst, src))


def aligned_buffer(nbytes: int) -> np.ndarray:
    """Zeroed uint8 array whose address is 4 KiB aligned (O_DIRECT needs it)."""
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start : start + nbytes]


def odirect_read_gbps(
    paths: Sequence[str], file_bytes: int, nbytes: int, repeats: int, *, median: bool = False
) -> float:
    """Sequential O_DIRECT reads of ``nbytes`` striped over ``paths`` (each ``file_bytes``
    long), ``ODIRECT_CHUNK`` a command: the drive's streaming read rate, no page cache."""
    chunk = min(ODIRECT_CHUNK, file_bytes)
    buffer = aligned_buffer(chunk)
    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths]

    def read_all() -> None:
        left, at = nbytes, 0
        while left:
            n = min(chunk, left, file_bytes - at % file_bytes)
            fd = fds[(at // file_bytes) % len(fds)]
            os.preadv(fd, [memoryview(buffer[:n])], at % file_bytes)
            left, at = left - n, at + n

    try:
        measure = median_gbps if median else best_gbps
        return measure(nbytes, repeats, read_all)
    finally:
        for fd in fds:
            os.close(fd)


def odirect_write_gbps(
    path: str, data: np.ndarray, repeats: int, *, median: bool = False, sync: bool = False
) -> float:
    """Sequential O_DIRECT writes of ``data`` (uint8, a multiple of 4 KiB) over ``path``,
    ``ODIRECT_CHUNK`` a command, into space allocated and written once beforehand (as a
    store's pre-allocated pool is); with ``sync`` each pass ends with an fdatasync. The
    drive's streaming write rate; leaves the file holding ``data``."""
    flat = data.reshape(-1)
    if flat.nbytes % ALIGN:
        raise ValueError(f"O_DIRECT writes need a multiple of {ALIGN} bytes")
    staging = aligned_buffer(min(ODIRECT_CHUNK, flat.nbytes))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)

    def write_all() -> None:
        for at in range(0, flat.nbytes, staging.nbytes):
            n = min(staging.nbytes, flat.nbytes - at)
            staging[:n] = flat[at : at + n]  # the caller's buffer need not be aligned
            os.pwritev(fd, [memoryview(staging[:n])], at)
        if sync:
            os.fdatasync(fd)

    try:
        os.posix_fallocate(fd, 0, flat.nbytes)
        write_all()  # first touch of the extents, untimed
        measure = median_gbps if median else best_gbps
        return measure(flat.nbytes, repeats, write_all)
    finally:
        os.close(fd)


# ---- a local cluster and the service's bench config ---------------------------------------
# Every node of a bench cluster, and every process joining it, on 127.0.0.1. Ray otherwise
# takes the machine's outward address (its route to 8.8.8.8) for each node it starts, and
# rewrites a 127.0.0.1 address given to ``ray.init`` into it, unless
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set before Ray is first imported: here, since every
# bench imports this module before Ray (and the raylets it starts inherit it). The nodes'
# address is also stated, so a process that imported Ray first still starts loopback nodes.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
LOOPBACK_IP = "127.0.0.1"
# No autoscaler monitor and no log monitors: nothing here scales, and no driver of a local
# cluster takes its workers' logs (``log_to_driver=False``). Both poll in the background
# while a bench times; without them a node starts on a CPU-second less and stops a second
# sooner. The head's arguments add ``QUIET_HEAD``, every other node's ``QUIET_NODE``.
QUIET_NODE = {"include_log_monitor": False}
QUIET_HEAD = {"no_monitor": True, **QUIET_NODE}


def start_local_cluster(
    nodes: int, resource: str, *, on_head: bool = True, node_cpus: int = 1, bare_nodes: int = 0
) -> Any:
    """A ``ray.cluster_utils.Cluster`` on 127.0.0.1 with ``nodes`` nodes offering ``resource``
    (so the service lands only on these nodes, never on another cluster's): the one-CPU head
    among them, or (``on_head=False``) beside them, offering nothing, for the driver alone;
    and ``bare_nodes`` nodes offering nothing. A node that did not start (a loaded machine)
    leaves nothing of the cluster running."""
    from ray.cluster_utils import Cluster

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    head = {
        "node_ip_address": LOOPBACK_IP,
        "num_cpus": 1,
        "include_dashboard": False,
        "resources": {resource: 1} if on_head else {},
        **QUIET_HEAD,
    }
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(nodes - on_head):
            cluster.add_node(
                node_ip_address=LOOPBACK_IP,
                num_cpus=node_cpus,
                resources={resource: 1},
                **QUIET_NODE,
            )
        for _ in range(bare_nodes):
            cluster.add_node(node_ip_address=LOOPBACK_IP, num_cpus=node_cpus, **QUIET_NODE)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def bench_folder(parent: str | None, prefix: str) -> str:
    """A fresh folder for one bench run's stores, inside ``parent`` (made if missing;
    ``/var/tmp`` by default). The run removes this folder when it ends, never ``parent``:
    ``--root /var/tmp`` once removed ``/var/tmp`` itself."""
    parent = parent or "/var/tmp"
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=parent)


@contextmanager
def running_service(
    config: ServiceConfig,
    address: str | None,
    nodes: int,
    resource: str,
    root: str,
    *,
    bare_nodes: int = 0,
) -> Iterator[list[str]]:
    """The service started on the Ray cluster at ``address``, or on a local one of ``nodes``
    nodes offering ``resource`` (and ``bare_nodes`` more that do not, for clients off every
    storage node's machine); yields the Ray node ids it runs on (at most ``nodes``). On exit
    the service, Ray and the local cluster stop, and ``root`` and its arenas go."""
    import ray

    from flatcake_ray.client import deploy as service

    cluster = None if address else start_local_cluster(nodes, resource, bare_nodes=bare_nodes)
    where = address if cluster is None else cluster.address
    ray.init(address=where, namespace=config.namespace, log_to_driver=False)
    try:
        targets = service.service_nodes(None if address else resource)[:nodes]
        service.start(config, nodes=targets)
        yield targets
    finally:
        service.stop(config.namespace)
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def bench_service_config(
    namespace: str,
    root: str,
    layers: int,
    page_bytes: int,
    *,
    dram_bytes: int,
    ssd_bytes: int,
    files: int = 2,
    request_bytes: int = 0,
) -> ServiceConfig:
    """A service config for benchmarks: ``dram_bytes`` of arena and ``ssd_bytes`` of pool per
    node (rounded up to 4 MiB per file), the pool written once in the background
    (``ssd_prewrite``), no fsync, long RPC timeouts (loaded 2-core VMs).
    A bench is one tenant: its arena is one chunk, and its landing area holds a put's two
    layer slots of a ``request_bytes`` request, so a request is in DRAM when the bench asks
    (a service's 8 chunks of a bench-sized arena are each smaller than one such request:
    its DRAM puts went to SSD and its SSD puts sent their layers in their calls)."""
    file_bytes = -(-max(ssd_bytes // files, 8 << 20) // (4 << 20)) * (4 << 20)
    slots = 2 * -(-request_bytes // layers // (4 << 20)) * (4 << 20)
    return ServiceConfig(
        namespace=namespace,
        root=os.path.join(root, "{node}"),
        layers=layers,
        page_bytes=page_bytes,
        dram_bytes=-(-dram_bytes // (4 << 20)) * (4 << 20),
        dram_chunks=1,
        landing_bytes=max(ServiceConfig.landing_bytes, slots + (4 << 20)),
        ssd_files_per_dir=files,
        ssd_file_bytes=file_bytes,
        ssd_prewrite=True,  # as examples/flatcake-service.json: puts overwrite written space
        # Nothing live to yield to before the bench times anything (await_prewrite), and
        # a neighbour's I/O on a shared machine must not stretch the wait.
        ssd_prewrite_paced=False,
        fsync=False,
        rpc_timeout_s=60.0,
    )


def await_prewrite(client: Any, timeout_s: float = 300.0) -> float:
    """Seconds until every node's SSD pool is written once (``ssd_prewrite``), as a deployed
    node's is soon after its first start: a bench then times its SSD writes into written
    space. ``client`` is a FlatCakeClient; a prewrite that stopped early raises."""
    started = time.perf_counter()
    while True:
        nodes = client.stats()["nodes"].values()
        errors = [n["ssd_prewrite_error"] for n in nodes if n["ssd_prewrite_error"]]
        if errors:
            raise RuntimeError(f"SSD pool prewrite stopped: {errors}")
        pending = sum(n["ssd_prewrite_pending"] for n in nodes)
        if not pending:
            return time.perf_counter() - started
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"SSD pools still {pending} bytes from written after {timeout_s} s")
        time.sleep(0.1)


# ---- when a run's figures may go into BENCHMARKS.md -------------------------------------------
MAX_START_LOAD = 1.5  # a run that starts above this load average measured the neighbours
MAX_LIMIT_SAG = 0.20  # a limit sampled beside a row this far below the run's best: contended


def load_average() -> float:
    """The 1-minute load average, rounded (recorded before and after every run)."""
    return round(os.getloadavg()[0], 2)


def best_limits(samples: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per limit name, the best value sampled anywhere in the run."""
    best: dict[str, float] = {}
    for sample in samples:
        for name, value in sample.items():
            best[name] = max(best.get(name, 0.0), float(value))
    return best


def unfit_for_record(
    load_before: float,
    row_limits: dict[str, dict[str, float]],
    run_limits: dict[str, float] | None = None,
    *,
    max_load: float = MAX_START_LOAD,
    max_sag: float = MAX_LIMIT_SAG,
) -> list[str]:
    """Why a run's figures must not be written into BENCHMARKS.md; empty when they may.

    ``row_limits``: per row, the limits (GB/s by name) measured beside it; ``run_limits``: any
    measured elsewhere in the run (its start). A row is set against a limit sampled beside it,
    so a limit that sagged there (the machine was busy with something else) makes the row's
    fraction meaningless, and a run that began above ``max_load`` measured its neighbours."""
    reasons = []
    if load_before > max_load:
        reasons.append(f"the run started at load average {load_before:.2f} (> {max_load})")
    best = best_limits([*row_limits.values(), *([run_limits] if run_limits else [])])
    for row, limits in row_limits.items():
        for name, value in sorted(limits.items()):
            if best.get(name) and value < (1 - max_sag) * best[name]:
                sag = 1 - value / best[name]
                reasons.append(
                    f"{row}: {name} beside it was {value:.2f} GB/s, {sag:.0%} below the run's "
                    f"best {best[name]:.2f}"
                )
    return reasons
