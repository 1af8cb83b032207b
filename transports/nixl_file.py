"""Reads of one local file's ranges through NIXL's POSIX backend.

Owner-side helper for "remote-ssd-shipped": it shares :mod:`.nixl_dram`'s agent and reader
code (validation, agent ownership, a failed transfer breaking the reader for good).
"""

from __future__ import annotations

import os

import numpy as np

from flatcake_ray.transports.base import ReadBatch, TransferStats
from flatcake_ray.transports.nixl_dram import (
    DEFAULT_TIMEOUT_S,
    NixlAgent,
    _descriptors,
    _NixlReader,
    nixl_probe,
    unique_agent_name,
)


class NixlFileReader(_NixlReader):
    """Reads ranges of one file into host memory through NIXL's POSIX backend.

    Owner-side helper for "remote-ssd-shipped" (never chosen by ``route``): source offsets
    are file offsets. The file is opened read-only (buffered) and kept open until close.
    """

    name = "nixl-posix-file"

    def __init__(self, path: str | os.PathLike[str], *, timeout_s: float = DEFAULT_TIMEOUT_S):
        self._path = os.fspath(path)
        self._fd = os.open(self._path, os.O_RDONLY)
        agent = None
        try:
            self._size = os.fstat(self._fd).st_size
            agent = NixlAgent(unique_agent_name("posix"), backends=("POSIX",))
            self._registration = agent.register_file(self._fd, self._size)
        except BaseException:
            os.close(self._fd)
            if agent is not None:
                agent.close()
            raise
        super().__init__(agent, True, timeout_s)

    @classmethod
    def probe(cls) -> str | None:
        return nixl_probe("POSIX")

    def read(self, reads: ReadBatch, dst: np.ndarray) -> TransferStats:
        reads = self._checked(reads, dst, self._size, self._path)
        remote = _descriptors(reads.src_offsets, reads.lengths, device=self._fd)
        return self._transfer(self._agent.name, reads, dst, remote, "FILE")

    def close(self) -> None:
        if self._agent is None:
            return
        try:
            self._agent.deregister(self._registration)
        finally:
            self._close_agent()
            os.close(self._fd)
