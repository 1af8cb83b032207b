"""The node's end of direct call channels (``media/call_frames.py`` says why and how).

Who calls what: a client on the node's machine calls ``StorageNode.open_calls`` over Ray
with its tenant's secret and the name of the socket it listens on; the node connects to it
here and serves that connection on a thread of its own, one call after another, each by the
same ``StorageNode`` method a Ray call would run, with the secret that opened it (so the
tenant's gate, limits and checks are the same). Only ``DIRECT_CALLS`` (a request's lookups
and releases, a put's opening and commit) are served; a bad frame ends the connection (the
client asks over Ray again).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from flatcake_ray.errors import ShapeError, TenantLimitError
from flatcake_ray.media.call_frames import (
    DIRECT_CALLS,
    ChannelClosedError,
    connect,
    pack_error,
    pack_reply,
    recv_frame,
    send_frame,
    unpack_call,
)

log = logging.getLogger(__name__)
CHANNELS_PER_TENANT = 64  # a thread each on the node: a tenant's clients on one machine
Dispatch = Callable[[object, str, tuple[Any, ...]], Any]  # (secret, method, args) -> answer


class CallChannels:
    def __init__(self, dispatch: Dispatch, per_tenant: int, timeout_s: float) -> None:
        self._dispatch = dispatch
        self._per_tenant = per_tenant
        self._timeout_s = timeout_s
        self._open: dict[str, set[socket.socket]] = {}
        self._lock = threading.Lock()
        self.served = 0  # calls answered over channels (stats)

    def open(self, tenant: str, secret: object, socket_name: object) -> None:
        """Connect to the client listening on ``socket_name`` and serve it for ``tenant``."""
        with self._lock:
            if len(self._open.get(tenant, ())) >= self._per_tenant:
                raise TenantLimitError(
                    f"tenant {tenant!r} has {self._per_tenant} call channels open here"
                )
            sock = connect(socket_name, self._timeout_s)  # type: ignore[arg-type]
            self._open.setdefault(tenant, set()).add(sock)
        thread = threading.Thread(
            target=self._serve, args=(tenant, secret, sock), daemon=True, name="flatcake-calls"
        )
        thread.start()

    def count(self) -> int:
        with self._lock:
            return sum(len(socks) for socks in self._open.values())

    def close(self) -> None:
        with self._lock:
            socks = [sock for held in self._open.values() for sock in held]
            self._open.clear()
        for sock in socks:
            sock.shutdown(socket.SHUT_RDWR)  # wakes its thread, which closes it

    def _serve(self, tenant: str, secret: object, sock: socket.socket) -> None:
        try:
            while True:
                method, args = unpack_call(recv_frame(sock))
                send_frame(sock, self._answer(secret, method, args))
        except (ChannelClosedError, ShapeError, OSError) as exc:
            # The client went (or sent what no client sends): its calls go over Ray again.
            log.debug("call channel of %s ends: %s", tenant, exc)
        finally:
            with self._lock:
                self._open.get(tenant, set()).discard(sock)
            sock.close()

    def _answer(self, secret: object, method: str, args: tuple[Any, ...]) -> bytes:
        if method not in DIRECT_CALLS:
            return pack_error(ShapeError(f"{method!r} is not a direct call"))
        try:
            answer = self._dispatch(secret, method, args)
        except Exception as exc:  # every error goes back typed, as a Ray call raises it
            return pack_error(exc)
        self.served += 1
        return pack_reply(answer)
