"""A client's direct calls to a storage node (``media/call_frames.py``).

The locator asks a node its lookups, finds, probes and releases here instead of over Ray
(``Locator.call_all``, ``Locator.release``), and a put its opening and commit
(``RemotePut._ask``): one socket round trip where a Ray actor call costs more than the node's
work. To the node on the client's machine over a Unix socket, to a node on another machine
over TCP (``ClientConfig.remote_direct_calls``). A release nobody waits on is posted: sent,
and its answer read by the next call on its connection or by ``settle`` (before this
client's next put). Connections are pooled (a thread takes one for a call, so concurrent
restores do not queue behind each other), each opened by one ``open_calls``
(``open_remote_calls``) actor call. Anything wrong with a channel is
:class:`ChannelClosedError`, and the caller asks over Ray instead; a channel that could not
be opened is not tried again for ``RETRY_AFTER_S`` (TCP: ``TCP_RETRY_AFTER_S``, as what
stops it, a firewall between the machines, rarely goes away).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from flatcake_ray.errors import CallLostError, ChannelClosedError, FlatCakeError
from flatcake_ray.media.call_frames import (
    DIRECT_CALLS,
    CallListener,
    TcpCallListener,
    pack_call,
    recv_frame,
    send_frame,
    unpack_reply,
)

log = logging.getLogger(__name__)
__all__ = ["DIRECT_CALLS", "DirectCalls", "PendingCall"]
RETRY_AFTER_S = 5.0
TCP_RETRY_AFTER_S = 60.0

IDLE_KEPT = 8  # connections kept for reuse; more are closed when given back


class PendingCall:
    """A direct call sent, its answer not read yet (``DirectCalls.send``)."""

    def __init__(self, calls: DirectCalls, sock: socket.socket, method: str) -> None:
        self._calls = calls
        self._sock = sock
        self.method = method

    def result(self) -> Any:
        """The node's answer (its typed error raised here); CallLostError when the
        connection broke after the call was sent (the node may have run it)."""
        return self._calls._answer(self._sock, self.method)


class DirectCalls:
    def __init__(self, handle: Any, timeout_s: float, *, over_tcp: bool = False) -> None:
        self._handle = handle  # the node's BoundNode: open_calls carries the tenant's secret
        self._timeout_s = timeout_s
        self._over_tcp = over_tcp  # the node is on another machine
        self._idle: list[socket.socket] = []
        # Connections whose last call was posted (``post``): its answer is still to be read.
        # The node serves a connection's calls in order, so it has run once that is read.
        self._unread: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._retry_at = 0.0
        self.calls = 0  # answered over a channel
        self.failures = 0  # channels that failed to open or broke (the calls went over Ray)

    def call(self, method: str, *args: Any) -> Any:
        """The node's answer to ``method(*args)`` (its typed error raised here), or
        ChannelClosedError when the channel could not carry it."""
        return self.send(method, *args).result()

    def send(self, method: str, *args: Any) -> PendingCall:
        """Send ``method(*args)``; its answer is read by the returned call's ``result`` (the
        caller sends to several nodes, then reads: their round trips overlap).
        ChannelClosedError when the channel could not carry it."""
        try:
            body = pack_call(method, args)
        except (TypeError, ValueError, OverflowError) as exc:  # e.g. an int key past 64 bits
            message = f"a direct {method} cannot carry its arguments: {exc}"
            raise ChannelClosedError(message) from exc
        sock = self._take()
        try:
            send_frame(sock, body)
        except OSError as exc:
            sock.close()
            self._failed(f"direct {method} failed: {exc}", retry_now=True)
            raise ChannelClosedError(f"direct {method}: {exc}") from exc
        return PendingCall(self, sock, method)

    def _answer(self, sock: socket.socket, method: str) -> Any:
        """The answer of the call sent on ``sock`` (the connection goes back to the pool)."""
        try:
            body = recv_frame(sock)
        except (OSError, FlatCakeError) as exc:
            sock.close()
            self._failed(f"direct {method} failed: {exc}", retry_now=True)
            raise CallLostError(f"direct {method}: {exc}") from exc
        self._give(sock)
        self.calls += 1
        return unpack_reply(body)

    def post(self, method: str, *args: Any) -> None:
        """Send ``method(*args)`` and do not wait for its answer (a release whose reader needs
        none): the answer is read, and dropped, by the next call on that connection or by
        ``settle``. ChannelClosedError when the channel could not carry it."""
        body = pack_call(method, args)
        sock = self._take()
        try:
            send_frame(sock, body)
        except OSError as exc:
            sock.close()
            self._failed(f"direct {method} failed: {exc}", retry_now=True)
            raise ChannelClosedError(f"direct {method}: {exc}") from exc
        self.calls += 1
        with self._lock:
            self._unread.add(sock)
        self._give(sock)

    def settle(self) -> None:
        """Return once every posted call has run at the node (or its connection broke)."""
        with self._lock:
            waiting = [sock for sock in self._idle if sock in self._unread]
            self._idle = [sock for sock in self._idle if sock not in self._unread]
        for sock in waiting:
            if self._read_posted(sock):
                self._give(sock)

    def _read_posted(self, sock: socket.socket) -> bool:
        """Read (and drop) the answer of the call posted on ``sock``; False: it broke."""
        with self._lock:
            self._unread.discard(sock)
        try:
            unpack_reply(recv_frame(sock))
        except FlatCakeError as exc:  # the node refused it: a posted call's outcome is unread
            log.debug("a posted call was refused: %s", exc)
        except OSError as exc:
            sock.close()
            self._failed(f"a posted call's answer was lost: {exc}", retry_now=True)
            return False
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._unread.clear()
        for sock in idle:
            sock.close()

    def _take(self) -> socket.socket:
        while True:
            with self._lock:
                if self._closed:
                    raise ChannelClosedError("the link was closed")
                if not self._idle:
                    break
                # One whose answers are all read first: a posted call's answer may not be in
                # yet (the node may still be running it).
                ready = [i for i, idle in enumerate(self._idle) if idle not in self._unread]
                sock = self._idle.pop(ready[-1] if ready else -1)
                posted = sock in self._unread
            if not posted or self._read_posted(sock):
                return sock
        with self._lock:
            if time.monotonic() < self._retry_at:
                raise ChannelClosedError("no call channel to this node for now")
        return self._open()

    def _give(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < IDLE_KEPT:
                self._idle.append(sock)
                return
            posted = sock in self._unread
        if posted and not self._read_posted(sock):
            return  # closed already
        sock.close()

    def _open(self) -> socket.socket:
        from ray.exceptions import RayError

        try:
            sock = self._open_tcp() if self._over_tcp else self._open_unix()
        except (RayError, FlatCakeError, OSError) as exc:
            self._failed(f"no call channel: {exc}", retry_now=False)
            raise ChannelClosedError(f"no call channel to the node: {exc}") from exc
        sock.settimeout(self._timeout_s)  # a node that hangs: over Ray, then down
        return sock

    def _open_unix(self) -> socket.socket:
        import ray

        with CallListener() as listener:
            ref = self._handle.open_calls.remote(listener.name)
            pid = ray.get(ref, timeout=self._timeout_s)
            return listener.accept_from(pid, self._timeout_s)

    def _open_tcp(self) -> socket.socket:
        import ray

        with TcpCallListener(ray.util.get_node_ip_address()) as listener:
            address = (listener.host, listener.port, listener.token)
            ref = self._handle.open_remote_calls.remote(*address)
            ray.get(ref, timeout=self._timeout_s)
            return listener.accept_token(self._timeout_s)

    def _failed(self, reason: str, *, retry_now: bool) -> None:
        """A broken channel is opened again by the next call (the node may have restarted);
        one that could not be opened waits ``RETRY_AFTER_S``."""
        log.info("%s; asking over Ray", reason)
        with self._lock:
            self.failures += 1
            if not retry_now:
                wait_s = TCP_RETRY_AFTER_S if self._over_tcp else RETRY_AFTER_S
                self._retry_at = time.monotonic() + wait_s
