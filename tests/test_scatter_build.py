"""Loading and building the scatter kernel library: importing loads neither torch nor the
library, the loader's reasoned fallbacks, and the nvcc build and its check."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flatcake_ray.cuda_ext import _library, build, scatter
from flatcake_ray.cuda_ext.scatter import ScatterKernelError, ScatterLibraryError
from tests.test_scatter import NO_NVCC, requires_nvcc

# ------------------------------------------------------------------- import and loading


def test_import_loads_neither_torch_nor_the_library() -> None:
    probe = (
        "import sys\n"
        "import flatcake_ray.cuda_ext\n"
        "assert 'torch' not in sys.modules, 'package import pulled in torch'\n"
        "from flatcake_ray.cuda_ext import scatter_layer, _library\n"
        "import torch\n"
        "assert not _library.is_loaded(), 'library loaded at import'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised at import'\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)


@pytest.fixture
def fresh_loader(monkeypatch):
    _library.reset_cache()
    yield monkeypatch
    _library.reset_cache()


def test_missing_default_library_is_a_reasoned_fallback(fresh_loader, tmp_path) -> None:
    fresh_loader.delenv(_library.LIBRARY_ENV, raising=False)
    fresh_loader.setattr(_library, "default_library_path", lambda: tmp_path / "none.so")
    loaded = _library.load()
    assert loaded.library is None
    assert "no scatter library built" in loaded.reason
    assert not scatter.kernel_available()


def test_env_library_must_exist_and_load(fresh_loader, tmp_path) -> None:
    fresh_loader.setenv(_library.LIBRARY_ENV, str(tmp_path / "absent.so"))
    with pytest.raises(ScatterLibraryError, match="names no file"):
        scatter.kernel_available()
    _library.reset_cache()
    not_a_library = tmp_path / "text.so"
    not_a_library.write_text("not ELF")
    fresh_loader.setenv(_library.LIBRARY_ENV, str(not_a_library))
    with pytest.raises(ScatterLibraryError, match="cannot load"):
        scatter.kernel_available()


# ------------------------------------------------------------------------------- building


def test_build_without_nvcc_exits_zero_and_says_why(monkeypatch, capsys) -> None:
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    assert build.main(["--check"]) == build.EXIT_OK
    assert "torch reference path" in capsys.readouterr().out


def test_failing_nvcc_exits_nonzero(capsys) -> None:
    assert build.main(["--check", "--nvcc", "/bin/false"]) == build.EXIT_COMPILE_FAILED
    assert "FAILED" in capsys.readouterr().err


def test_check_with_out_is_a_usage_error(tmp_path) -> None:
    assert build.main(["--check", "--out", str(tmp_path)]) == build.EXIT_USAGE


@pytest.fixture(scope="module")
def built_library(tmp_path_factory) -> build.BuiltLibrary:
    if build.find_nvcc() is None:
        pytest.skip(NO_NVCC)
    return build.build_library(tmp_path_factory.mktemp("scatter-build"))


@requires_nvcc
def test_library_compiles_and_exports_the_abi(built_library) -> None:
    print(f"built {built_library.path.name} for sm_{list(built_library.archs)}")
    assert built_library.path.name == _library.library_name()
    assert 90 in built_library.archs
    library = _library.open_library(built_library.path)
    assert library.abi_version() == _library.ABI_VERSION
    assert library.error_string(0) == "no error"
    assert isinstance(library.driver_status(), int)
    library.scatter_pages(0, 0, 0, 0, 16, 16, 1, 0, 0)  # nothing to copy: no CUDA call
    with pytest.raises(ScatterKernelError, match="CUDA error 1"):
        library.scatter_pages(1, 1, 1, -1, 16, 16, 1, 0, 0)  # cudaErrorInvalidValue


@requires_nvcc
def test_check_cli_compiles_without_torch() -> None:
    probe = (
        "import runpy, sys\n"
        "sys.modules['torch'] = None  # the build must not need torch\n"
        "sys.argv = ['build', '--check', '--arch', '80']\n"
        "runpy.run_module('flatcake_ray.cuda_ext.build', run_name='__main__')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "scatter kernel compiles" in result.stdout
