"""Finding and loading the nvcc-built scatter library (stdlib only: the build imports this).

The library's file name carries a digest of ``scatter.cu``, so a library built from an older
source is never picked up: after an edit it is simply "not built" until rebuilt. The
environment variable ``FLATCAKE_SCATTER_LIB`` names a library file explicitly; a library
named that way must exist and load, or :class:`ScatterLibraryError` is raised.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from flatcake_ray.errors import ScatterKernelError, ScatterLibraryError

ABI_VERSION = 1  # must equal kAbiVersion in scatter.cu
LIBRARY_ENV = "FLATCAKE_SCATTER_LIB"
CUDA_SUCCESS = 0
SOURCE_PATH = Path(__file__).with_name("scatter.cu")


def source_digest() -> str:
    """First 12 hex digits of the SHA-256 of ``scatter.cu``."""
    return hashlib.sha256(SOURCE_PATH.read_bytes()).hexdigest()[:12]


def library_name() -> str:
    return f"libflatcake_scatter-{source_digest()}.so"


def default_build_dir() -> Path:
    """``<repo>/build/cuda_ext`` in a source checkout, else a per-user cache folder."""
    repo_root = Path(__file__).resolve().parent.parent
    if (repo_root / "pyproject.toml").is_file() and (repo_root / "cuda_ext").is_dir():
        return repo_root / "build" / "cuda_ext"
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "flatcake_ray" / "cuda_ext"


def default_library_path() -> Path:
    return default_build_dir() / library_name()


@dataclass(frozen=True)
class ScatterLibrary:
    """The loaded library with its C signatures declared."""

    path: Path
    handle: ctypes.CDLL

    def scatter_pages(
        self,
        src: int,
        dst_base: int,
        page_index: int,
        num_pages: int,
        page_bytes: int,
        index_stride_bytes: int,
        index_limit: int,
        device: int,
        stream: int,
    ) -> None:
        """Launches the kernel (asynchronous); raises :class:`ScatterKernelError` on failure."""
        code = self.handle.flatcake_scatter_pages(
            src,
            dst_base,
            page_index,
            num_pages,
            page_bytes,
            index_stride_bytes,
            index_limit,
            device,
            stream,
        )
        if code != CUDA_SUCCESS:
            raise ScatterKernelError(code, self.error_string(code))

    def error_string(self, code: int) -> str:
        return self.handle.flatcake_scatter_error_string(code).decode(errors="replace")

    def abi_version(self) -> int:
        return self.handle.flatcake_scatter_abi_version()

    def driver_status(self) -> int:
        return self.handle.flatcake_scatter_driver_status()


def open_library(path: Path) -> ScatterLibrary:
    """Loads ``path`` and checks its ABI version; raises :class:`ScatterLibraryError`."""
    try:
        handle = ctypes.CDLL(str(path))
    except OSError as exc:
        raise ScatterLibraryError(f"cannot load scatter library {path}: {exc}") from exc
    try:
        _declare_signatures(handle)
    except AttributeError as exc:
        raise ScatterLibraryError(f"{path} is not a FlatCake scatter library: {exc}") from exc
    library = ScatterLibrary(path=path, handle=handle)
    found = library.abi_version()
    if found != ABI_VERSION:
        raise ScatterLibraryError(
            f"{path} has scatter ABI {found}, this package needs {ABI_VERSION}; rebuild it "
            "with `python -m flatcake_ray.cuda_ext.build`"
        )
    return library


def _declare_signatures(handle: ctypes.CDLL) -> None:
    i64 = ctypes.c_int64
    handle.flatcake_scatter_abi_version.argtypes = []
    handle.flatcake_scatter_abi_version.restype = ctypes.c_int
    handle.flatcake_scatter_driver_status.argtypes = []
    handle.flatcake_scatter_driver_status.restype = ctypes.c_int
    handle.flatcake_scatter_error_string.argtypes = [ctypes.c_int]
    handle.flatcake_scatter_error_string.restype = ctypes.c_char_p
    handle.flatcake_scatter_pages.argtypes = [
        ctypes.c_void_p,  # src (staging)
        ctypes.c_void_p,  # dst_base
        ctypes.c_void_p,  # page_index (device int64[num_pages])
        i64,  # num_pages
        i64,  # page_bytes
        i64,  # index_stride_bytes
        i64,  # index_limit
        ctypes.c_int,  # device
        ctypes.c_size_t,  # stream (cudaStream_t as uintptr_t)
    ]
    handle.flatcake_scatter_pages.restype = ctypes.c_int


@dataclass(frozen=True)
class LoadResult:
    """A usable library, or why there is none (for the one fallback log line)."""

    library: ScatterLibrary | None
    reason: str


_lock = threading.Lock()
_cached: LoadResult | None = None


def load() -> LoadResult:
    """The process-wide library, loaded on first call; later calls reuse the result."""
    global _cached
    with _lock:
        if _cached is None:
            _cached = _locate_and_open()
        return _cached


def is_loaded() -> bool:
    """Whether :func:`load` has run (for tests of import-time laziness)."""
    return _cached is not None


def reset_cache() -> None:
    """Forget the load result, so a library built since is found on the next call."""
    global _cached
    with _lock:
        _cached = None


def _locate_and_open() -> LoadResult:
    explicit = os.environ.get(LIBRARY_ENV)
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise ScatterLibraryError(f"{LIBRARY_ENV}={explicit!r} names no file")
    else:
        path = default_library_path()
        if not path.is_file():
            return LoadResult(None, f"no scatter library built for this source at {path}")
    library = open_library(path)
    status = library.driver_status()
    if status != CUDA_SUCCESS:
        # The CUDA 13 runtime linked in needs a 13.x driver; an older one cannot run it.
        reason = f"{path} cannot run here: {library.error_string(status)}"
        return LoadResult(None, reason)
    return LoadResult(library, f"loaded {path}")
