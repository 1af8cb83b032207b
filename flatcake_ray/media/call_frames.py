"""Direct calls between a client and a storage node: a Unix socket on the node's machine, TCP
from another machine.

A Ray actor call costs about 1.4 ms on the project's 2-core machines before the node does
any work, more than the lookup itself; a local client's lookups, finds and releases go over
a socket instead (``client/direct.py``, ``actors/call_channels.py``). The connection is made
the way chunks are handed out (``fd_handout.py``): the client listens on a fresh abstract
socket and names it in an actor call that carries its tenant's secret; the node connects,
and the client keeps the connection only if the process that connected is the node's
(``SO_PEERCRED``). The node never listens, and every call on a connection acts for the
tenant whose secret opened it. A client on another machine listens on its own cluster address
instead (``TcpCallListener``), a port the system picks, and names it with a fresh random
token in the actor call; the node connects (only to an address of a node of its Ray cluster)
and sends the token first, and the client keeps the connection that presents it: only the
node got the token, over Ray.

Frames are a 4-byte length and a body. A call is msgpack (the node unpickles nothing a client
sends): ``[method, args]``, numpy arrays as an extension type of a few integer dtypes. A reply
is a pickle made by the node (the client trusts the node's process, as it trusts Ray's).
"""

from __future__ import annotations

import dataclasses
import hmac
import pickle
import secrets
import socket
import struct
from typing import Any

import msgpack
import numpy as np

from flatcake_ray.core.keys import DIGEST_DTYPE, PageKey
from flatcake_ray.core.records import PutHints
from flatcake_ray.errors import (
    ChannelClosedError,
    FlatCakeError,
    ServiceError,
    ShapeError,
)
from flatcake_ray.media import peer_socket

# The calls of every request (a lookup, a chain's find, a prefix probe, a restore's release,
# a put's opening and commit): the only ones a channel carries.
DIRECT_CALLS = frozenset({"lookup", "find", "exists", "probe", "gvas", "release"})
DIRECT_CALLS |= {"begin_put", "commit_put"}
SOCKET_PREFIX = "flatcake-call-"
MAX_CALL_BYTES = 64 << 20  # a lookup of the most keys a call may name is far below this
_LENGTH = struct.Struct("!I")
_ARRAY, _HINTS, _PAGE_KEY = 1, 2, 3  # msgpack extension codes: a numpy array, PutHints, PageKey
# What a direct call carries in arrays: packed digests, lease and scope ids, bytes.
_DTYPES = {"digest": DIGEST_DTYPE, "i8": np.dtype("<i8"), "u8": np.dtype("<u8")}
_DTYPES["u1"] = np.dtype("u1")
TOKEN_BYTES = 16  # what a node presents on a TCP channel it opened (TcpCallListener)
# A TCP channel's token is in by the time the client accepts (the node sent it before its
# open_remote_calls returned): a connection that does not present it at once is not the node.
_TOKEN_WAIT_S = 0.5


def check_socket_name(name: object) -> str:
    return peer_socket.check_socket_name(name, SOCKET_PREFIX, "CallListener")


# ---- frames ---------------------------------------------------------------------------------
def send_frame(sock: socket.socket, body: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(body)) + body)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_CALL_BYTES) -> bytes:
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if length > max_bytes:
        raise ShapeError(f"a call frame of {length} bytes (at most {max_bytes})")
    return _recv_exactly(sock, length)


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    buffer = bytearray(count)
    view, got = memoryview(buffer), 0
    while got < count:
        step = sock.recv_into(view[got:], count - got)
        if step == 0:
            raise ChannelClosedError("the call channel was closed")
        got += step
    return bytes(buffer)


# ---- calls (client -> node: msgpack) -----------------------------------------------------
def pack_call(method: str, args: tuple[Any, ...]) -> bytes:
    return msgpack.packb([method, list(args)], default=_pack_ext, use_bin_type=True)


def unpack_call(body: bytes) -> tuple[str, tuple[Any, ...]]:
    """``(method, args)`` of a call, or ShapeError for anything else."""
    try:
        call = msgpack.unpackb(body, ext_hook=_unpack_ext, raw=False, strict_map_key=True)
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        raise ShapeError(f"a call is msgpack [method, args] ({exc})") from None
    if not (isinstance(call, list) and len(call) == 2 and isinstance(call[0], str)):
        raise ShapeError("a call is msgpack [method, args]")
    if not isinstance(call[1], list):
        raise ShapeError("a call's args are a list")
    return call[0], tuple(call[1])


def _pack_ext(value: Any) -> msgpack.ExtType | int:
    if isinstance(value, np.integer):
        return int(value)  # a scope or lease id taken from an array
    if isinstance(value, PutHints):
        return msgpack.ExtType(_HINTS, msgpack.packb(dataclasses.astuple(value)))
    if isinstance(value, PageKey):
        body = msgpack.packb([value.namespace, value.key], use_bin_type=True)
        return msgpack.ExtType(_PAGE_KEY, body)
    name = _dtype_name(value)
    if name is None:
        raise TypeError(f"a direct call does not carry {type(value).__name__}")
    header = msgpack.packb([name, list(value.shape)])
    return msgpack.ExtType(_ARRAY, header + np.ascontiguousarray(value).tobytes())


def _dtype_name(value: Any) -> str | None:
    if isinstance(value, np.ndarray):
        for name, dtype in _DTYPES.items():
            if value.dtype == dtype:
                return name
    return None


def _unpack_ext(code: int, data: bytes) -> np.ndarray | PutHints | PageKey:
    if code == _HINTS:
        fields = msgpack.unpackb(data)
        if not isinstance(fields, list) or len(fields) != len(dataclasses.fields(PutHints)):
            raise ValueError("PutHints are its fields")
        if not all(f is None or (type(f) is int) for f in fields):
            raise ValueError("PutHints' fields are ints or None")
        return PutHints(*fields)
    if code == _PAGE_KEY:
        namespace, key = msgpack.unpackb(data, raw=False)  # ValueError unless two
        if not isinstance(namespace, str) or type(key) not in (str, bytes, int):
            raise ValueError("a PageKey is a namespace str and a str, bytes or int key")
        return PageKey(namespace, key)
    if code != _ARRAY:
        raise ValueError(f"extension {code} is not an array")
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    dtype, shape = unpacker.unpack()
    body = data[unpacker.tell() :]
    if dtype not in _DTYPES or not isinstance(shape, list) or not 1 <= len(shape) <= 2:
        raise ValueError("an array of ints or bytes, of one or two dimensions")
    if not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError("an array's shape is counts")
    if len(body) != _DTYPES[dtype].itemsize * int(np.prod(shape)):
        raise ValueError(f"{len(body)} bytes are not a {dtype} array of shape {shape}")
    array = np.frombuffer(body, dtype=_DTYPES[dtype])
    return array.reshape(shape)


# ---- replies (node -> client: pickle) ------------------------------------------------------
def pack_reply(value: Any) -> bytes:
    return pickle.dumps((True, value), protocol=5)


def pack_error(error: BaseException) -> bytes:
    """A typed error as the node raised it; anything else (a fault in the node, as a Ray
    call would report it) as ServiceError."""
    if not isinstance(error, FlatCakeError):
        error = ServiceError(f"the node failed: {type(error).__name__}: {error}")
    try:
        return pickle.dumps((False, error), protocol=5)
    except (pickle.PicklingError, TypeError, AttributeError):
        return pickle.dumps((False, ServiceError(f"{type(error).__name__}: {error}")))


def unpack_reply(body: bytes) -> Any:
    """The node's answer, or the typed error it raised, raised here."""
    ok, value = pickle.loads(body)
    if not ok:
        raise value
    return value


# ---- connecting ---------------------------------------------------------------------------
class CallListener(peer_socket.PeerListener):
    """A fresh abstract socket that takes one connection, from one process."""

    def __init__(self) -> None:
        super().__init__(SOCKET_PREFIX, socket.SOCK_STREAM, "call channel")


def connect(socket_name: str, timeout_s: float) -> socket.socket:
    """The node's end: connect to the client's listener."""
    address = "\0" + check_socket_name(socket_name)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(address)
    except OSError as error:
        sock.close()
        raise ServiceError(f"no process of this machine listens for calls: {error}") from error
    sock.settimeout(None)
    return sock


class TcpCallListener(peer_socket.Listener):
    """Listens on ``host`` (this machine's cluster address), a port the system picks, for the
    connection of one node on another machine: the one that presents ``token`` first. Any
    other connection is closed."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.token = secrets.token_bytes(TOKEN_BYTES)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__(socket.socket(family, socket.SOCK_STREAM), "call channel")
        self.port: int = self._sock.getsockname()[1]

    def _bind(self) -> None:
        self._sock.bind((self.host, 0))

    def accept_token(self, timeout_s: float) -> socket.socket:
        """The connection that presented the token (blocking; TransferTimeoutError if none
        came in ``timeout_s``)."""
        return self._accept_kept(timeout_s, self._presents_token, "its node")

    def _presents_token(self, conn: socket.socket) -> bool:
        conn.settimeout(_TOKEN_WAIT_S)
        try:
            presented = _recv_exactly(conn, TOKEN_BYTES)
        except (OSError, ChannelClosedError):
            return False
        if not hmac.compare_digest(presented, self.token):
            return False
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return True


def check_tcp_address(host: object, port: object, token: object) -> tuple[str, int, bytes]:
    """``(host, port, token)`` as a TcpCallListener names them, else ShapeError."""
    if not isinstance(host, str) or not host or len(host) > 255:
        raise ShapeError("a call channel's host is an address")
    if type(port) is not int or not 0 < port < 65536:
        raise ShapeError("a call channel's port is 1-65535")
    if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
        raise ShapeError(f"a call channel's token is {TOKEN_BYTES} bytes")
    return host, port, token


def connect_tcp(host: str, port: int, token: bytes, timeout_s: float) -> socket.socket:
    """The node's end of a TCP channel: connect to the client's listener, present the token."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as error:
        raise ServiceError(f"no client listens for calls at {host}:{port}: {error}") from error
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(token)
    except OSError as error:
        sock.close()
        raise ServiceError(f"the call channel to {host}:{port} broke: {error}") from error
    sock.settimeout(None)
    return sock
