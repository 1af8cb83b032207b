"""Build the page-scatter library with nvcc: ``python -m flatcake_ray.cuda_ext.build``.

Options: ``--check`` (compile into a temporary folder and report; the CI compile check),
``--out DIR`` (default: ``build/cuda_ext`` in a source checkout, else a per-user cache),
``--arch 90`` (repeatable; default sm_80, sm_90 and sm_100, those this nvcc knows),
``--nvcc PATH``.

Exit status: 0 when built, and also when no nvcc exists (the kernel is then simply not built
and CUDA tensors use the torch path); 1 when nvcc exists and the compile fails; 2 for bad
arguments. No torch is imported, so this runs on a bare machine with only python3 and nvcc.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flatcake_ray.cuda_ext._library import (
    SOURCE_PATH,
    ScatterLibraryError,
    default_build_dir,
    library_name,
    open_library,
)

WANTED_ARCHS = (80, 90, 100)  # A100, H100/H200, B200; sm_8x/sm_10x minors run these binaries
EXIT_OK = 0
EXIT_COMPILE_FAILED = 1
EXIT_USAGE = 2
COMPILE_TIMEOUT_S = 600


class BuildError(Exception):
    """nvcc exists but could not build the library."""


def find_nvcc() -> Path | None:
    """``$NVCC``, then ``nvcc`` on PATH, then ``$CUDA_HOME/bin/nvcc``, ``/usr/local/cuda``."""
    candidates = [os.environ.get("NVCC"), shutil.which("nvcc")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(str(Path(root) / "bin" / "nvcc"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def supported_archs(nvcc: Path) -> set[int]:
    """The ``sm_NN`` numbers this nvcc can generate code for."""
    result = _run([str(nvcc), "--list-gpu-arch"], "listing GPU architectures")
    return {int(number) for number in re.findall(r"compute_(\d+)", result.stdout)}


def gencode_flags(archs: Sequence[int]) -> list[str]:
    """SASS for each arch, plus PTX of the newest so later GPUs can JIT it."""
    flags = []
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    newest = max(archs)
    flags += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
    return flags


def compile_command(nvcc: Path, archs: Sequence[int], output: Path) -> list[str]:
    return [
        str(nvcc),
        "-O3",
        "-std=c++17",
        "-shared",
        "-Xcompiler",
        "-fPIC,-fvisibility=hidden",
        # Keep the static cudart's symbols local: no interposition with torch's libcudart.
        "-Xlinker",
        "--exclude-libs,ALL",
        *gencode_flags(archs),
        str(SOURCE_PATH),
        "-o",
        str(output),
    ]


def choose_archs(nvcc: Path, requested: Sequence[int] | None) -> list[int]:
    known = supported_archs(nvcc)
    if requested:
        unknown = sorted(set(requested) - known)
        if unknown:
            raise BuildError(f"{nvcc} cannot build for sm_{unknown}; it knows {sorted(known)}")
        return sorted(set(requested))
    chosen = [arch for arch in WANTED_ARCHS if arch in known]
    if not chosen:
        raise BuildError(f"{nvcc} supports none of sm_{list(WANTED_ARCHS)} ({sorted(known)})")
    return chosen


@dataclass(frozen=True)
class BuiltLibrary:
    path: Path
    archs: tuple[int, ...]


def build_library(
    out_dir: Path | None = None, archs: Sequence[int] | None = None, nvcc: Path | None = None
) -> BuiltLibrary:
    """Compiles ``scatter.cu`` into ``out_dir`` (default :func:`default_build_dir`).

    Raises :class:`BuildError` when nvcc is missing or fails. The library is written under a
    temporary name and renamed, so a concurrent loader never sees half a file.
    """
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found")
    chosen = choose_archs(nvcc, archs)
    out_dir = Path(out_dir) if out_dir is not None else default_build_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / library_name()
    partial = out_dir / f".{os.getpid()}.{target.name}"
    try:
        _run(compile_command(nvcc, chosen, partial), f"compiling {SOURCE_PATH.name}")
        try:
            open_library(partial)  # refuse to install a library the loader would reject
        except ScatterLibraryError as exc:
            raise BuildError(str(exc)) from exc
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return BuiltLibrary(path=target, archs=tuple(chosen))


def _run(command: list[str], doing: str) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, check=False, timeout=COMPILE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{doing} failed: {exc}") from exc
    if result.returncode != 0:
        raise BuildError(
            f"{doing} failed (exit {result.returncode}):\n{' '.join(command)}\n"
            f"{result.stdout}{result.stderr}"
        )
    return result


def _arch_names(archs: Sequence[int]) -> str:
    return ", ".join(f"sm_{arch}" for arch in archs)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flatcake_ray.cuda_ext.build",
        description="Build the FlatCake page-scatter CUDA library with nvcc.",
    )
    parser.add_argument(
        "--check", action="store_true", help="compile into a temporary folder and report"
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    parser.add_argument(
        "--arch", type=int, action="append", default=None, help="sm number, e.g. 90; repeatable"
    )
    parser.add_argument("--nvcc", type=Path, default=None, help="path of nvcc")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.check and args.out is not None:
        print("--check builds into a temporary folder; drop --out", file=sys.stderr)
        return EXIT_USAGE
    nvcc = args.nvcc or find_nvcc()
    if nvcc is None:
        print(
            "nvcc not found: the scatter kernel is not built; CUDA tensors will use the "
            "torch reference path (set NVCC or CUDA_HOME to build it)"
        )
        return EXIT_OK
    try:
        if args.check:
            with tempfile.TemporaryDirectory(prefix="flatcake-scatter-") as scratch:
                built = build_library(Path(scratch), args.arch, nvcc)
                print(f"scatter kernel compiles with {nvcc} for {_arch_names(built.archs)}")
        else:
            built = build_library(args.out, args.arch, nvcc)
            print(f"built {built.path} for {_arch_names(built.archs)}")
    except BuildError as exc:
        print(f"scatter kernel build FAILED: {exc}", file=sys.stderr)
        return EXIT_COMPILE_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
