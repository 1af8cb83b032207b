"""The node's end of direct call channels (``media/call_frames.py`` says why and how).

Who calls what: a client on the node's machine calls ``StorageNode.open_calls`` over Ray
with its tenant's secret and the name of the socket it listens on; the node connects to it
here and serves that connection on a thread of its own, one call after another, each by the
same ``StorageNode`` method a Ray call would run, with the secret that opened it (so the
tenant's gate, limits and checks are the same). A client on another machine calls
``StorageNode.open_remote_calls`` with the TCP address it listens on and a token; the node
connects only to an address of a node of its own Ray cluster (it is not a way to make the
node reach anywhere else) and presents the token. Only ``DIRECT_CALLS`` (a request's lookups
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
    check_tcp_address,
    connect,
    connect_tcp,
    pack_error,
    pack_reply,
    recv_frame,
    send_frame,
    unpack_call,
)

log = logging.getLogger(__name__)
CHANNELS_PER_TENANT = 64  # a thread each on the node: a tenant's clients
# A client on another machine that cannot be reached (a firewall) costs its open call this
# long at most, then asks over Ray (client/direct.py waits before trying again).
TCP_CONNECT_S = 2.0
Dispatch = Callable[[object, str, tuple[Any, ...]], Any]  # (secret, method, args) -> answer


def cluster_hosts() -> frozenset[str]:
    """The addresses of the live nodes of this Ray cluster."""
    import ray

    return frozenset(node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"])


class CallChannels:
    def __init__(
        self,
        dispatch: Dispatch,
        per_tenant: int,
        timeout_s: float,
        hosts: Callable[[], frozenset[str]] = cluster_hosts,
    ) -> None:
        self._dispatch = dispatch
        self._per_tenant = per_tenant
        self._timeout_s = timeout_s
        self._hosts = hosts
        self._open: dict[str, set[socket.socket]] = {}
        self._lock = threading.Lock()
        self.served = 0  # calls answered over channels (stats)

    def open(self, tenant: str, secret: object, socket_name: object) -> None:
        """Connect to the client on this machine listening on ``socket_name`` and serve it
        for ``tenant``."""
        # connect() checks the name: one a CallListener made.
        self._serve_new(tenant, secret, lambda: connect(socket_name, self._timeout_s))  # type: ignore[arg-type]

    def open_remote(
        self, tenant: str, secret: object, host: object, port: object, token: object
    ) -> None:
        """Connect to the client on another machine listening on ``host:port``, present
        ``token``, and serve it for ``tenant``; ShapeError for an address outside the
        cluster."""
        address = check_tcp_address(host, port, token)
        if address[0] not in self._hosts():
            raise ShapeError(f"{address[0]} is not the address of a node of this cluster")
        timeout_s = min(self._timeout_s, TCP_CONNECT_S)
        self._serve_new(tenant, secret, lambda: connect_tcp(*address, timeout_s))

    def _serve_new(
        self, tenant: str, secret: object, connect_to: Callable[[], socket.socket]
    ) -> None:
        self._check_room(tenant)
        sock = connect_to()  # not under the lock: a TCP connect may take seconds
        try:
            with self._lock:
                self._check_room(tenant)
                self._open.setdefault(tenant, set()).add(sock)
        except TenantLimitError:
            sock.close()
            raise
        thread = threading.Thread(
            target=self._serve, args=(tenant, secret, sock), daemon=True, name="flatcake-calls"
        )
        thread.start()

    def _check_room(self, tenant: str) -> None:
        if len(self._open.get(tenant, ())) >= self._per_tenant:
            raise TenantLimitError(
                f"tenant {tenant!r} has {self._per_tenant} call channels open here"
            )

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
