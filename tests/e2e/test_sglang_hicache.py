"""SGLang: a real ``sglang.Engine`` (0.5.23) on CPU with HiCache on and FlatCake loaded as its
L3 storage backend through ``hicache_storage_backend="dynamic"``.

Request 1 saves the prefix (write-through to the L3), ``flush_cache()`` empties SGLang's
device and host caches, request 2 shares the prefix: SGLang's own ``cached_tokens_details``
must report the prefix as ``storage`` tokens from this backend, and the output ids must equal
an engine's without HiCache. The engines run in a child process (``sglang_run.py``), where
the three CPU shims of ``sglang_shims.py`` are installed, spawned subprocesses included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
        }
    )
    store_root = str(tmp_path_factory.mktemp("sgl") / "store")
    run = subprocess.run(
        [sys.executable, str(HERE / "sglang_run.py"), tiny_model, store_root],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    reopen_and_close(store_root)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, f"SGLang run failed:\n{run.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


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
