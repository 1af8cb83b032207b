"""A fresh abstract Unix socket that keeps only the connection of one expected process
(``PeerListener``), on the accept loop every listener of the project shares (``Listener``:
also ``call_frames.TcpCallListener``).

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
from collections.abc import Callable
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


class Listener:
    """A listening socket that keeps the first connection ``keeps`` accepts and closes every
    other unread (anyone may connect to an abstract name or a TCP port). ``what``: what the
    connection carries, for the timeout's message."""

    def __init__(self, sock: socket.socket, what: str) -> None:
        self.what = what
        self._sock = sock
        try:
            self._bind()
            self._sock.listen(8)
        except BaseException:
            self._sock.close()
            raise

    def _bind(self) -> None:
        raise NotImplementedError

    def _accept_kept(
        self, timeout_s: float, keeps: Callable[[socket.socket], bool], whose: str
    ) -> socket.socket:
        """The first connection ``keeps`` accepts (blocking; any other is closed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                conn, _ = self._sock.accept()
            except TimeoutError as error:
                raise TransferTimeoutError(
                    f"no {self.what} from {whose} in {timeout_s:.1f} s"
                ) from error
            if keeps(conn):
                conn.settimeout(None)
                return conn
            conn.close()

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PeerListener(Listener):
    """Listens on ``prefix`` + a random token; ``accept_from`` takes one process's
    connection."""

    def __init__(self, prefix: str, kind: int, what: str) -> None:
        self.name = prefix + secrets.token_hex(_TOKEN_HEX // 2)
        super().__init__(socket.socket(socket.AF_UNIX, kind), what)

    def _bind(self) -> None:
        self._sock.bind("\0" + self.name)

    def accept_from(self, pid: int, timeout_s: float) -> socket.socket:
        """The connection process ``pid`` made (blocking; any other process's is closed)."""

        def made_by_pid(conn: socket.socket) -> bool:
            raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            return _PEERCRED.unpack(raw)[0] == pid

        return self._accept_kept(timeout_s, made_by_pid, f"process {pid}")
