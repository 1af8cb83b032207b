"""Test-only shims that let SGLang 0.5.23's real ``sglang.Engine`` run HiCache on CPU.

PyPI's SGLang wheels assume CUDA in three places a CPU run reaches; each shim says what it
replaces, and each fails loudly (ShimError) when SGLang moves the names it patches:

1. ``sgl_kernel``: PyPI's kernel wheel has no CPU ops. SGLang imports it (and looks up
   ``torch.ops.sgl_kernel.*_cpu``) at import time even on paths that never call it; this
   module stands in, and every op it provides raises if it is ever called.
2. ``torchvision``: PyPI's builds do not load against the CPU torch; SGLang's multimodal
   modules import it at package import. A stub package whose attributes raise if used.
3. The host KV pool: ``cudaHostRegister`` pinning and the host<->device KV copy kernels are
   CUDA-only; pure-torch replacements (no pinning; index_copy between tensors).

The engine's subprocesses (scheduler, detokenizer) are spawned, so ``install`` also runs in
them: ``sglang_boot/sitecustomize.py`` calls it when FLATCAKE_E2E_SGLANG_SHIMS=1.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class ShimError(RuntimeError):
    """SGLang moved a name a shim patches, or code called a stubbed CUDA op."""


class _Stub:
    """Any name under a stubbed package: attributes are stubs too (enums, namespaces), and
    calling one raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> _Stub:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ShimError(f"{self._name} is a CPU-test stub (tests/e2e/sglang_shims.py), called")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)  # a class deriving from a stub is a plain class


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        return None


def _settle_transformers() -> None:
    """transformers asks once (cached) whether torchvision exists; asked before the stub is
    in place, it answers no and never routes image work through the stub."""
    from transformers.utils import import_utils

    for probe in ("is_torchvision_available", "is_torchvision_v2_available"):
        if not hasattr(import_utils, probe):
            raise ShimError(f"transformers.utils.import_utils.{probe} moved")
        if getattr(import_utils, probe)():
            raise ShimError("a real torchvision is installed: remove it (see requirements-e2e)")


def _patch(module: Any, name: str, replacement: Any, *, must_exist: bool = True) -> None:
    if must_exist and not hasattr(module, name):
        raise ShimError(f"{module.__name__}.{name} moved: update tests/e2e/sglang_shims.py")
    setattr(module, name, replacement)


def _no_host_register(buffer: Any, registration_granularity_bytes: Any = None) -> None:
    """Replaces cudaHostRegister of the host pool: CPU memory needs no pinning here."""


def _no_host_unregister(buffer: Any) -> None:
    """Replaces cudaHostUnregister of the host pool."""


def transfer_kv_direct(
    src_layers: list, dst_layers: list, src_indices: Any, dst_indices: Any, page_size: int
) -> None:
    """Replaces sgl_kernel's host<->device KV copy for the ``direct`` io backend and the
    ``layer_first`` layout: token rows ``src_indices`` of each source layer go to rows
    ``dst_indices`` of the matching destination layer."""
    import torch

    if len(src_layers) != len(dst_layers):
        raise ShimError(f"{len(src_layers)} source layers for {len(dst_layers)} destinations")
    src_rows = src_indices.to(torch.long).cpu()
    dst_rows = dst_indices.to(torch.long).cpu()
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst.index_copy_(0, dst_rows.to(dst.device), src.index_select(0, src_rows.to(src.device)))


def _patch_host_pool() -> None:
    from sglang.srt.mem_cache.pool_host import common, mha

    _patch(common, "_cuda_host_register", _no_host_register)
    _patch(common, "_cuda_host_unregister", _no_host_unregister)
    # mha imports the CUDA copy kernels only when CUDA exists: on CPU the name is absent,
    # and HiCache's "direct" path would fail with a NameError without this.
    if "transfer_kv_direct" not in mha.__dict__ and "transfer_kv_direct(" not in _source(mha):
        raise ShimError("sglang.srt.mem_cache.pool_host.mha no longer calls transfer_kv_direct")
    _patch(mha, "transfer_kv_direct", transfer_kv_direct, must_exist=False)


def _source(module: Any) -> str:
    import inspect

    return inspect.getsource(module)


def install() -> None:
    _settle_transformers()
    sys.meta_path.insert(0, _StubFinder(("sgl_kernel", "torchvision")))
    _patch_host_pool()
