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
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flatcake_ray.errors import ForeignMemoryError, ShapeError
from flatcake_ray.media import peer_socket

SOCKET_PREFIX = "flatcake-fd-"
MAX_CHUNKS = 4096  # per hand-out: every chunk of the largest arena (config_store.MAX_DRAM_CHUNKS)
_PER_MESSAGE = 250  # descriptors a message (SCM_RIGHTS takes at most 253)


@dataclass(frozen=True)
class HandedChunk:
    """A chunk of a node's memory as this process received it: where it sits in that memory,
    its length, and a descriptor this process owns (close it once mapped)."""

    offset: int
    nbytes: int
    fd: int


def check_socket_name(name: object) -> str:
    return peer_socket.check_socket_name(name, SOCKET_PREFIX, "ChunkReceiver")


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


class ChunkReceiver(peer_socket.PeerListener):
    """A fresh abstract socket that takes one hand-out from one process."""

    def __init__(self) -> None:
        super().__init__(SOCKET_PREFIX, socket.SOCK_SEQPACKET, "hand-out")

    def receive(self, sender_pid: int, count: int, timeout_s: float) -> list[HandedChunk]:
        """The ``count`` chunks process ``sender_pid`` sent (connections of any other
        process are dropped, their descriptors closed)."""
        with self.accept_from(sender_pid, timeout_s) as conn:
            return _read_chunks(conn, count)


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
