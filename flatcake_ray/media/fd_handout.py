"""Handing a node's memory (arena and landing chunks, memfds) to a client process on the same
machine, as descriptors over a Unix socket (``SCM_RIGHTS``).

The chunks have no path, so a descriptor is the only way in. The client listens on a fresh
abstract socket and sends its name in an actor call (which carries its tenant's secret);
the node checks that every chunk asked for is that tenant's, connects, and sends their
descriptors before the call returns. The client takes descriptors only from the node's own
process (``SO_PEERCRED``): abstract names are listed in ``/proc/net/unix``, so another
process may connect first, and its descriptors are dropped unread. The node never listens:
nothing reaches it but its actor calls and the call channels those open (``call_frames.py``).
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flatcake_ray.errors import ForeignMemoryError, ShapeError, TransferTimeoutError

SOCKET_PREFIX = "flatcake-fd-"
MAX_CHUNKS = 4096  # per hand-out: every chunk of the largest arena (config.MAX_DRAM_CHUNKS)
_PER_MESSAGE = 250  # descriptors a message (SCM_RIGHTS takes at most 253)
_NAME_BYTES = len(SOCKET_PREFIX) + 32
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(frozen=True)
class HandedChunk:
    """A chunk of a node's memory as this process received it: where it sits in that memory,
    its length, and a descriptor this process owns (close it once mapped)."""

    offset: int
    nbytes: int
    fd: int


def check_socket_name(name: object) -> str:
    if (
        not isinstance(name, str)
        or len(name) != _NAME_BYTES
        or not name.startswith(SOCKET_PREFIX)
        or not all(c in "0123456789abcdef" for c in name[len(SOCKET_PREFIX) :])
    ):
        raise ShapeError("a hand-out socket name is the one ChunkReceiver made")
    return name


def send_chunks(socket_name: str, chunks: Sequence[tuple[int, int, int]], timeout_s: float) -> None:
    """Send (offset, bytes, fd) of each chunk to the process listening on ``socket_name``,
    in messages of at most ``_PER_MESSAGE`` (an empty hand-out is one empty message)."""
    if len(chunks) > MAX_CHUNKS:
        raise ShapeError(f"at most {MAX_CHUNKS} chunks a hand-out")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + check_socket_name(socket_name))
        except OSError as error:
            raise ForeignMemoryError(
                f"no process of this machine listens for the chunks: {error}"
            ) from error
        for first in range(0, max(len(chunks), 1), _PER_MESSAGE):
            batch = chunks[first : first + _PER_MESSAGE]
            header = np.array([(offset, nbytes) for offset, nbytes, _ in batch], dtype="<i8")
            socket.send_fds(sock, [header.tobytes() or b"\0"], [fd for _, _, fd in batch])


class ChunkReceiver:
    """A fresh abstract socket that takes one hand-out from one process."""

    def __init__(self) -> None:
        self.name = SOCKET_PREFIX + secrets.token_hex(16)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.bind("\0" + self.name)
            self._sock.listen(8)
        except BaseException:
            self._sock.close()
            raise

    def receive(self, sender_pid: int, count: int, timeout_s: float) -> list[HandedChunk]:
        """The ``count`` chunks process ``sender_pid`` sent (connections of any other
        process are dropped, their descriptors closed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                conn, _ = self._sock.accept()
            except TimeoutError as error:
                raise TransferTimeoutError(
                    f"no hand-out from process {sender_pid} in {timeout_s:.1f} s"
                ) from error
            with conn:
                raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
                if _PEERCRED.unpack(raw)[0] == sender_pid:
                    return _read_chunks(conn, count)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> ChunkReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_chunks(conn: socket.socket, count: int) -> list[HandedChunk]:
    conn.settimeout(5.0)  # the sender wrote before its call returned
    fds: list[int] = []
    spans: list[tuple[int, int]] = []
    try:
        cut = False
        while not cut:  # the sender sends at least one message, full ones but the last
            data, got, flags, _ = socket.recv_fds(conn, 16 * _PER_MESSAGE, _PER_MESSAGE)
            fds += got
            pairs = np.frombuffer(data[: 16 * len(got)], dtype="<i8").reshape(-1, 2)
            spans += [(int(offset), int(size)) for offset, size in pairs]
            cut = bool(flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC)) or len(spans) != len(fds)
            if len(got) < _PER_MESSAGE or len(fds) >= count:
                break
        if cut or len(fds) != count:
            raise ForeignMemoryError(f"a hand-out of {len(fds)} chunks, {count} expected")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return [HandedChunk(o, n, fd) for (o, n), fd in zip(spans, fds, strict=True)]
