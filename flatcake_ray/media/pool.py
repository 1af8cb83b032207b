"""The O_DIRECT SSD file pool of a node: pre-allocated single-extent files, one folder per drive.

Addressed by pool offsets (the GVA's Offset field of an SSD page). Knows nothing of keys or
scopes; the catalog decides where bytes go.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np

from flatcake_ray.errors import MediumFullError
from flatcake_ray.failpoints import failpoint
from flatcake_ray.media.drive_activity import DriveActivity
from flatcake_ray.media.log import log_once
from flatcake_ray.media.pool_prewrite import STEP, PoolPrewrite, pwrite_whole

# Allocation failures that mean "this disk cannot hold the configured pool".
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class SsdPool:
    """Pre-allocated single-extent files, one folder per drive, opened O_DIRECT.

    File ``i`` covers pool offsets ``[i * file_bytes, (i + 1) * file_bytes)``; files are
    numbered round-robin over folders so consecutive scopes land on different drives.
    """

    def __init__(
        self,
        folders: tuple[str, ...],
        files_per_dir: int,
        file_bytes: int,
        *,
        prewrite: bool = False,
        prewrite_step: int = STEP,
        prewrite_paced: bool = True,
    ) -> None:
        """``prewrite``: write the never-written space once in the background
        (``pool_prewrite.py``), in ``prewrite_step`` steps, each waiting while others use its
        drive unless ``prewrite_paced`` is off."""
        self.file_bytes = file_bytes
        self.paths: list[str] = []
        for i in range(files_per_dir * len(folders)):
            folder = Path(folders[i % len(folders)])
            folder.mkdir(parents=True, exist_ok=True)
            self.paths.append(str(folder / f"pool-{i:04d}.fc"))
        self.direct = True
        self.fds: list[int] = []
        self.prewrite: PoolPrewrite | None = None
        try:
            for path in self.paths:
                self.fds.append(self._open(path))
            # Buffered I/O (O_DIRECT refused) writes back through the page cache: nothing to gain.
            if prewrite and self.direct:
                activity = DriveActivity.of if prewrite_paced else None
                self.prewrite = PoolPrewrite(
                    self.fds, file_bytes, prewrite_step, len(folders), activity=activity
                )
        except BaseException:
            self.close()  # a failed open leaves no descriptor behind
            raise

    def _open(self, path: str) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < self.file_bytes:
                failpoint("pool.allocate", path=path)
                os.posix_fallocate(fd, 0, self.file_bytes)
        except OSError as exc:
            if exc.errno not in _NO_SPACE:
                raise
            raise MediumFullError(
                f"SSD pool file {path}: cannot allocate {self.file_bytes} bytes "
                f"({os.strerror(exc.errno)}); lower ssd_file_bytes or ssd_files_per_dir"
            ) from exc
        finally:
            os.close(fd)
        try:
            return os.open(path, os.O_RDWR | os.O_DIRECT)
        except OSError:
            # tmpfs and some overlay filesystems refuse O_DIRECT; stay correct, say so once.
            log_once("odirect", "SSD pool at %s: O_DIRECT refused, using buffered I/O", path)
            self.direct = False
            return os.open(path, os.O_RDWR)

    @classmethod
    def open_readonly(cls, paths: list[str] | tuple[str, ...], file_bytes: int) -> SsdPool:
        """Open another process's pool files O_DIRECT, read-only (a client's local-SSD path).

        Creates and sizes nothing: the files must exist, as the owning store made them.
        """
        pool = cls.__new__(cls)
        pool.file_bytes = file_bytes
        pool.paths = [str(p) for p in paths]
        pool.direct = True
        pool.fds = []
        pool.prewrite = None  # the owning store writes the pool; a reader never does
        try:
            for path in pool.paths:
                pool.fds.append(pool._open_readonly(path))
        except OSError:
            pool.close()
            raise
        return pool

    def _open_readonly(self, path: str) -> int:
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if not Path(path).exists():
                raise FileNotFoundError(f"SSD pool file {path} does not exist") from exc
            log_once("odirect-ro", "SSD pool at %s: O_DIRECT refused, using buffered I/O", path)
            self.direct = False
            return os.open(path, os.O_RDONLY)

    def locate(self, offset: int) -> tuple[int, int]:
        """(file index, offset in file) of a pool offset."""
        return divmod(offset, self.file_bytes)

    def write(self, offset: int, buffer: np.ndarray) -> None:
        """Write an aligned buffer at an aligned pool offset (one command per call)."""
        failpoint("pool.write", offset=offset)
        file_index, file_offset = self.locate(offset)
        if self.prewrite is not None:
            self.prewrite.claim(file_index, file_offset, file_offset + buffer.nbytes)
        pwrite_whole(self.fds[file_index], memoryview(buffer), file_offset)

    def read_into(self, file_index: int, file_offset: int, buffer: np.ndarray) -> int:
        done = 0
        while done < buffer.size:
            got = os.preadv(self.fds[file_index], [memoryview(buffer[done:])], file_offset + done)
            if got == 0:
                raise OSError(f"short read at {file_offset + done} of {self.paths[file_index]}")
            done += got
        return done

    def sync(self, offset: int) -> None:
        os.fdatasync(self.fds[self.locate(offset)[0]])

    @property
    def prewrite_pending(self) -> int:
        """Bytes of never-written pool space the prewriter has still to write (0: none; more
        after it stopped: see :attr:`prewrite_error`)."""
        return 0 if self.prewrite is None else self.prewrite.pending_bytes

    @property
    def prewrite_waited_s(self) -> float:
        """Seconds the prewriter has waited for its drives to be idle (live I/O first)."""
        return 0.0 if self.prewrite is None else self.prewrite.paused_seconds

    @property
    def prewrite_error(self) -> str:
        """Why the prewriter stopped early (empty: it did not)."""
        error = None if self.prewrite is None else self.prewrite.error
        return "" if error is None else str(error)

    def close(self) -> None:
        if self.prewrite is not None:
            self.prewrite.close()  # before its descriptors go
        for fd in self.fds:
            os.close(fd)
        self.fds = []
