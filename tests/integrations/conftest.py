"""Engine integration tests: they run against the engines' own classes, installed in the
separate ``.venv-engines`` (``make test-integrations``), and skip with the reason elsewhere."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import types

import pytest

# vLLM reads these at import: CPU platform, no usage reporting.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
# The harness is a one-process engine (scheduler and worker side by side); without this,
# vLLM's CPU platform turns the uni executor into mp, under which the connector refuses an
# in-process store.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 3,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# Warnings raised inside the engines and torch while they import or plan, never by our code.
# pytest turns warnings into errors (pyproject), so each is let through by its exact text.
ENGINE_WARNINGS = (
    # torch.compile's import path (pulled in by vLLM) still defines torch.jit script methods
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in ENGINE_WARNINGS:
        config.addinivalue_line("filterwarnings", line)


def require_vllm() -> None:
    """Skip unless vLLM imports (it is not in the main test venv)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make test-integrations)")


def require_sglang_storage() -> None:
    """Import SGLang's HiCache storage API, or skip.

    ``sglang/__init__.py`` imports the whole runtime (triton, CUDA kernels). The storage
    API does not need it, so when the full import fails, ``sglang`` is registered as a bare
    package over the installed folder and only the storage modules load from it.
    """
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (make test-integrations)", allow_module_level=True)
    try:
        importlib.import_module("sglang.srt.mem_cache.hicache_storage")
        return
    except ImportError:
        folder = importlib.util.find_spec("sglang").submodule_search_locations[0]
    for name in [name for name in sys.modules if name == "sglang" or name.startswith("sglang.")]:
        del sys.modules[name]
    bare = types.ModuleType("sglang")
    bare.__path__ = [folder]
    bare.__spec__ = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
    bare.__spec__.submodule_search_locations = [folder]
    sys.modules["sglang"] = bare
    importlib.import_module("sglang.srt.mem_cache.hicache_storage")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(folder)


@pytest.fixture
def local_store_options(tmp_path):
    """Options for an in-process store on real files; every store it opens is closed after."""
    from flatcake_ray.integrations._common import close_local_stores

    yield {
        "store": "local",
        "store_root": str(tmp_path / "store"),
        "store_dram_bytes": "4MiB",
        "store_ssd_file_bytes": "8MiB",
        "store_ssd_files_per_dir": 2,
        "store_ssd_min_run_bytes": "256KiB",
        "store_fsync": False,
    }
    harness = sys.modules.get("tests.integrations.vllm_harness")
    if harness is not None:
        harness.shutdown_engines()  # engines let go of their stores before the stores close
    close_local_stores()


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    """vLLM's ModelConfig of the tiny Llama (a vLLM test module has called require_vllm)."""
    from tests.integrations.vllm_harness import model_config

    return model_config(tiny_model_dir)


@pytest.fixture(scope="session")
def ray_services(tmp_path_factory):
    """``options_for(layers, page_bytes)``: the connector options of a FlatCake-Ray service on
    a local Ray started for this session (a service serves one page geometry, so one per
    geometry, each in its own namespace). Everything is stopped at the end."""
    ray = pytest.importorskip("ray")
    from flatcake_ray.client import deploy
    from flatcake_ray.config import ServiceConfig

    root = tmp_path_factory.mktemp("ray-services")
    context = ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    address = context.address_info["address"]
    started: list[str] = []

    def options_for(layers: int, page_bytes: int) -> dict:
        namespace = f"fc-engines-{layers}x{page_bytes}"
        if namespace not in started:
            config = ServiceConfig(
                namespace=namespace,
                root=str(root / namespace / "{node}"),
                layers=layers,
                page_bytes=page_bytes,
                dram_bytes=4 << 20,
                ssd_file_bytes=8 << 20,
                ssd_files_per_dir=2,
                fsync=False,
                ship_bytes=1 << 20,
            )
            deploy.start(config, address=address)
            started.append(namespace)
        return {"store": "ray", "ray_namespace": namespace, "ray_address": address}

    yield options_for
    for namespace in started:
        deploy.stop(namespace)
    ray.shutdown()


@pytest.fixture(params=["local", "ray"])
def store_kind(request):
    return request.param
