"""SGLang: a real ``sglang.Engine`` (0.5.23) on CPU with HiCache on and FlatCake loaded as its
L3 storage backend through ``hicache_storage_backend="dynamic"``.

Request 1 saves the prefix (write-through to the L3), ``flush_cache()`` empties SGLang's
device and host caches, request 2 shares the prefix: SGLang's own ``cached_tokens_details``
must report the prefix as ``storage`` tokens from this backend, and the output ids must equal
an engine's without HiCache. The engines run in a child process (``sglang_run.py``), where
the three CPU shims of ``sglang_shims.py`` are installed, spawned subprocesses included.
The two engines (with HiCache, and the reference without) start at once, in two processes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (make test-e2e builds .venv-e2e)")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture(scope="module")
def result(tiny_model, tmp_path_factory):
    env = dict(os.environ)
    env.update(
        {
            "SGLANG_USE_CPU_ENGINE": "1",
            "FLATCAKE_E2E_SGLANG_SHIMS": "1",
            # the shims reach SGLang's spawned scheduler and detokenizer through this folder
            "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE / "sglang_boot")]),
            # SGLang's JIT-built page hash, cached with this venv rather than in ~/.cache,
            # where every venv on the machine that builds it invalidates the others' build
            "TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions"),
            "SGLANG_DISABLED_MODEL_ARCHS": ",".join(unused_model_modules()),
        }
    )
    folder = tmp_path_factory.mktemp("sgl")
    store_root = str(folder / "store")
    hicache_port, reference_port = free_ports(2)
    runs = {
        "hicache": ["hicache", tiny_model, store_root, str(hicache_port)],
        "reference": ["reference", tiny_model, str(reference_port)],
    }
    try:
        outputs = run_at_once(runs, env, folder, timeout_s=1200)
    finally:
        reopen_and_close(store_root)
    return {key: value for output in outputs.values() for key, value in output.items()}


def run_at_once(runs: dict[str, list[str]], env: dict, folder: Path, timeout_s: float) -> dict:
    """Each run is ``sglang_run.py`` in a process of its own, all started at once; returns
    each run's RESULT line, parsed. Output goes to files (no pipe fills up while waiting)."""
    deadline = time.monotonic() + timeout_s
    procs = {}
    for name, argv in runs.items():
        out, err = (open(folder / f"{name}.{kind}", "w") for kind in ("out", "err"))  # noqa: SIM115
        with out, err:
            command = [sys.executable, str(HERE / "sglang_run.py"), *argv]
            procs[name] = subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True)
    try:
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = {}
    for name, proc in procs.items():
        lines = (folder / f"{name}.out").read_text().splitlines()
        found = [line for line in lines if line.startswith("RESULT ")]
        stderr = (folder / f"{name}.err").read_text()
        assert proc.returncode == 0 and found, f"SGLang {name} run failed:\n{stderr[-6000:]}"
        results[name] = json.loads(found[-1][len("RESULT ") :])
    return results


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def unused_model_modules(needed: tuple[str, ...] = ("llama",)) -> list[str]:
    """SGLang's model registry imports every module of ``sglang.srt.models`` (about 250) in
    each engine's scheduler process, about a minute of a loaded 2-core machine per engine;
    the tiny model needs only ``llama`` (LlamaForCausalLM). Listed without importing SGLang."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    models = Path(spec.origin).parent / "srt" / "models"
    names = [module.name for module in pkgutil.iter_modules([str(models)]) if not module.ispkg]
    missing = set(needed) - set(names)
    assert not missing, f"sglang.srt.models has no {sorted(missing)}"
    return sorted(set(names) - set(needed))


def reopen_and_close(store_root: str) -> None:
    """SGLang's Engine.shutdown SIGKILLs its scheduler, where the in-process store lives, so
    that store never closes and its DRAM arena stays in /dev/shm. A store opened again on
    the root removes the arenas of dead owners (FlatCake's own recovery); close it at once."""
    from flatcake_ray.config import StoreConfig
    from flatcake_ray.node.store import FlatCakeStore
    from tests.e2e.tiny_model import HEAD_DIM, KV_HEADS, LAYERS

    if not Path(store_root).exists():
        return
    page_bytes = 2 * 32 * KV_HEADS * HEAD_DIM * 2  # one 32-token page of one layer, K and V
    config = StoreConfig(
        root=str(Path(store_root).resolve()),
        layers=LAYERS,
        page_bytes=page_bytes,
        dram_bytes=8 << 20,
        ssd_file_bytes=16 << 20,
        ssd_files_per_dir=2,
        ssd_min_run_bytes=256 << 10,
        fsync=False,
    )
    FlatCakeStore(config).close()


def test_prefix_comes_from_the_flatcake_backend(result):
    details = result["restored_details"]
    assert details["storage_backend"] == "FlatCakeHiCacheStorage"
    assert details["storage"] == result["prefix_tokens"]
    assert details["device"] == 0 and details["host"] == 0  # flushed: only the L3 had it


def test_output_ids_equal_an_engine_without_hicache(result):
    assert result["restored_ids"] == result["reference_ids"]
