"""A fresh abstract Unix socket that keeps only the connection of one expected process.

Both ways a storage node reaches a client process on its machine go through one of these:
chunk hand-outs (``fd_handout.py``) and direct call channels (``call_frames.py``). The
client listens under a random name it sends in an actor call; the node connects. Abstract
names are listed in ``/proc/net/unix``, so another process may connect first: a connection
is kept only if ``SO_PEERCRED`` names the node's process, any other is closed unread.
"""

from __future__ import annotations

import secrets
import socket
import struct
import time
from typing import Self

from flatcake_ray.errors import ShapeError, TransferTimeoutError

_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_TOKEN_HEX = 32


def check_socket_name(name: object, prefix: str, made_by: str) -> str:
    """``name`` if it is one a ``PeerListener`` with ``prefix`` made, else ShapeError."""
    if (
        not isinstance(name, str)
        or len(name) != len(prefix) + _TOKEN_HEX
        or not name.startswith(prefix)
        or not all(c in "0123456789abcdef" for c in name[len(prefix) :])
    ):
        raise ShapeError(f"a {made_by} socket name is the one {made_by} made")
    return name


class PeerListener:
    """Listens on ``prefix`` + a random token; ``accept_from`` takes one process's connection
    (``what``: what it carries, for the timeout's message)."""

    def __init__(self, prefix: str, kind: int, what: str) -> None:
        self.what = what
        self.name = prefix + secrets.token_hex(_TOKEN_HEX // 2)
        self._sock = socket.socket(socket.AF_UNIX, kind)
        try:
            self._sock.bind("\0" + self.name)
            self._sock.listen(8)
        except BaseException:
            self._sock.close()
            raise

    def accept_from(self, pid: int, timeout_s: float) -> socket.socket:
        """The connection process ``pid`` made (blocking; any other process's is closed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                conn, _ = self._sock.accept()
            except TimeoutError as error:
                raise TransferTimeoutError(
                    f"no {self.what} from process {pid} in {timeout_s:.1f} s"
                ) from error
            raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            if _PEERCRED.unpack(raw)[0] == pid:
                conn.settimeout(None)
                return conn
            conn.close()

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
