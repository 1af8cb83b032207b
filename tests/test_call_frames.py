"""Direct call frames (``media/call_frames.py``): what a client sends is msgpack the node
decodes into plain values or a few integer arrays, anything else is a ShapeError; replies
carry the node's typed errors; a listener keeps only the connection of the process it
expects. No Ray here: the channel through the live service is in ``test_tenant_service.py``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatcake_ray.actors.call_channels import CallChannels
from flatcake_ray.config import ClientConfig
from flatcake_ray.core.keys import PageKey, request_digests
from flatcake_ray.core.records import PutHints
from flatcake_ray.errors import (
    AccessDeniedError,
    ChannelClosedError,
    ServiceError,
    ShapeError,
    TenantLimitError,
    TransferTimeoutError,
)
from flatcake_ray.media.call_frames import (
    MAX_CALL_BYTES,
    TOKEN_BYTES,
    CallListener,
    TcpCallListener,
    check_socket_name,
    check_tcp_address,
    connect,
    connect_tcp,
    pack_call,
    pack_error,
    pack_reply,
    recv_frame,
    send_frame,
    unpack_call,
    unpack_reply,
)

plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(
    keys=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=40),
    ids=st.lists(st.integers(0, 2**63 - 1), max_size=8),
    extra=plain,
)
def test_a_call_comes_back_as_it_was_sent(keys, ids, extra):
    digests = request_digests(keys, None)
    method, args = unpack_call(pack_call("lookup", (digests, None, np.array(ids, "<i8"), extra)))
    assert method == "lookup"
    got_digests, none, got_ids, got_extra = args
    assert got_digests.dtype == digests.dtype and np.array_equal(got_digests, digests)
    assert none is None and got_ids.dtype == np.int64 and got_ids.tolist() == ids
    assert got_extra == extra


@settings(max_examples=60, deadline=None)
@given(
    hints=st.builds(
        PutHints,
        *[st.none() | st.integers(0, 2**40)] * 4,
    ),
    parent=st.none()
    | st.builds(
        PageKey, st.text(min_size=1, max_size=8), st.text(max_size=8) | st.binary(max_size=8)
    ),
    session=st.none() | st.text(max_size=8) | st.binary(max_size=8) | st.integers(0, 2**63),
)
def test_a_puts_opening_comes_back_as_it_was_sent(hints, parent, session):
    keys = ["a", b"b", 3, PageKey("ns", "d")]
    _, args = unpack_call(pack_call("begin_put", (keys, "ns", session, parent, hints)))
    assert args == (keys, "ns", session, parent, hints)
    assert [type(k) for k in args[0]] == [str, bytes, int, PageKey]


def test_a_key_past_64_bits_is_not_sent():
    """(The client then asks over Ray, which carries any int: ``client/direct.py``.)"""
    with pytest.raises((TypeError, OverflowError)):
        pack_call("begin_put", ([2**70], None, None, None, None))


def test_scalars_taken_from_arrays_travel_as_ints():
    _, (lease_id, scopes) = unpack_call(pack_call("release", (np.int64(7), [np.uint64(3)])))
    assert lease_id == 7 and scopes == [3] and type(lease_id) is int


@pytest.mark.parametrize("value", [np.zeros(3, "<f8"), np.zeros(2, "U3"), object()])
def test_what_no_request_holds_is_not_sent(value):
    with pytest.raises(TypeError):
        pack_call("lookup", (value,))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_a_call_or_a_shape_error(body):
    try:
        method, args = unpack_call(body)
    except ShapeError:
        return
    assert isinstance(method, str) and isinstance(args, tuple)


def _array_ext(dtype: str, shape: list, body: bytes) -> bytes:
    ext = msgpack.ExtType(1, msgpack.packb([dtype, shape]) + body)
    return msgpack.packb(["lookup", [ext]], use_bin_type=True)


@pytest.mark.parametrize(
    "body",
    [
        _array_ext("f8", [1], b"\0" * 8),  # a dtype no call carries
        _array_ext("i8", [2], b"\0" * 8),  # fewer bytes than the shape says
        _array_ext("i8", [1, 1, 1], b"\0" * 8),  # three dimensions
        _array_ext("i8", [2**40, 2**40], b""),  # a count past any array
        _array_ext("i8", [-1], b""),
        msgpack.packb(["lookup", [msgpack.ExtType(9, b"x")]]),  # an unknown extension
        msgpack.packb({"method": "lookup"}),
        msgpack.packb([1, []]),
        msgpack.packb(["lookup", "args"]),
        msgpack.packb(["begin_put", [msgpack.ExtType(2, msgpack.packb([1, 2]))]]),  # 2 fields
        msgpack.packb(["begin_put", [msgpack.ExtType(2, msgpack.packb(["1", 2, 3, 4]))]]),
        msgpack.packb(["begin_put", [msgpack.ExtType(3, msgpack.packb([1, "k"]))]]),
        msgpack.packb(["begin_put", [msgpack.ExtType(3, msgpack.packb(["ns", 1.5]))]]),
        msgpack.packb(["begin_put", [msgpack.ExtType(3, msgpack.packb(["ns"]))]]),
    ],
)
def test_a_malformed_call_is_a_shape_error(body):
    with pytest.raises(ShapeError):
        unpack_call(body)


@pytest.mark.parametrize(
    "error", [AccessDeniedError("no"), TenantLimitError("slow down"), ShapeError("bad keys")]
)
def test_a_typed_error_is_raised_at_the_caller_as_the_node_raised_it(error):
    with pytest.raises(type(error), match=str(error)):
        unpack_reply(pack_error(error))


def test_a_fault_in_the_node_reaches_the_caller_as_a_service_error():
    with pytest.raises(ServiceError, match="the node failed: OSError"):
        unpack_reply(pack_error(OSError(5, "failpoint")))
    assert unpack_reply(pack_reply({"hits": 3})) == {"hits": 3}


def test_frames_keep_their_bounds_and_a_closed_end_is_typed():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        send_frame(left, b"abc")
        send_frame(left, b"")
        assert recv_frame(right) == b"abc" and recv_frame(right) == b""
        left.sendall((MAX_CALL_BYTES + 1).to_bytes(4, "big"))
        with pytest.raises(ShapeError):
            recv_frame(right)
        left.close()
        with pytest.raises(ChannelClosedError):
            recv_frame(right)


def test_a_listener_keeps_only_the_expected_process_connection():
    """Another process that connects first (abstract names are listed in /proc/net/unix)
    is dropped; the expected process's connection is the one kept."""
    script = (
        "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect('\\0{}'); "
        "print('in', flush=True); sys.stdin.read()"
    )
    with CallListener() as listener:
        other = subprocess.Popen(
            [sys.executable, "-c", script.format(listener.name)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert other.stdout.readline().strip() == "in"  # queued before ours
            mine = connect(listener.name, 5.0)
            with mine, listener.accept_from(os.getpid(), 10.0) as conn:
                send_frame(mine, b"hello")
                assert recv_frame(conn) == b"hello"
            with pytest.raises(TransferTimeoutError):
                listener.accept_from(os.getpid(), 0.2)
        finally:
            other.kill()
            other.communicate()


@pytest.mark.parametrize("name", ["", "flatcake-call-xyz", "flatcake-fd-" + "0" * 32, 5])
def test_only_a_listener_made_name_is_connected_to(name):
    with pytest.raises(ShapeError):
        check_socket_name(name)
    with pytest.raises(ShapeError):
        connect(name, 1.0)


def test_direct_calls_come_from_every_source():
    assert ClientConfig().direct_calls is True
    assert ClientConfig.from_env({"FLATCAKE_DIRECT_CALLS": "0"}).direct_calls is False
    assert ClientConfig.from_env({}, direct_calls=False).direct_calls is False
    assert ClientConfig().remote_direct_calls is True
    environ = {"FLATCAKE_REMOTE_DIRECT_CALLS": "false"}
    assert ClientConfig.from_env(environ).remote_direct_calls is False
    assert ClientConfig.from_env({}, remote_direct_calls=False).remote_direct_calls is False


def test_a_tcp_listener_keeps_only_the_connection_that_presents_its_token():
    """Connections that present nothing, a wrong token or a short one (anyone can reach a
    TCP port) are closed; the node's, which presents the token, is kept, whatever came
    first."""
    with TcpCallListener("127.0.0.1") as listener:
        silent = socket.create_connection((listener.host, listener.port))
        wrong = connect_tcp(listener.host, listener.port, bytes(TOKEN_BYTES), 5.0)
        short = socket.create_connection((listener.host, listener.port))
        short.sendall(listener.token[:-1])
        node = connect_tcp(listener.host, listener.port, listener.token, 5.0)
        with silent, wrong, short, node, listener.accept_token(10.0) as conn:
            send_frame(node, b"hello")
            assert recv_frame(conn) == b"hello"
            send_frame(conn, b"back")
            assert recv_frame(node) == b"back"
            for dropped in (wrong, short):
                dropped.settimeout(5.0)
                assert dropped.recv(1) == b""  # closed by the listener, nothing sent
        with pytest.raises(TransferTimeoutError):
            listener.accept_token(0.2)


@pytest.mark.parametrize(
    "address",
    [
        ("", 1, bytes(TOKEN_BYTES)),
        ("127.0.0.1", 0, bytes(TOKEN_BYTES)),
        ("127.0.0.1", 65536, bytes(TOKEN_BYTES)),
        ("127.0.0.1", True, bytes(TOKEN_BYTES)),
        ("127.0.0.1", 80, b"short"),
        ("127.0.0.1", 80, "0" * TOKEN_BYTES),
        (5, 80, bytes(TOKEN_BYTES)),
    ],
)
def test_a_tcp_address_is_a_host_a_port_and_a_token(address):
    with pytest.raises(ShapeError):
        check_tcp_address(*address)


def test_a_node_connects_only_to_an_address_of_its_cluster():
    """``open_remote`` refuses a host that is not a node of the cluster (the node is no way
    to reach elsewhere) before connecting, and serves one that is, for the opening tenant."""
    asked: list[tuple[object, str, tuple]] = []

    def dispatch(secret: object, method: str, args: tuple) -> object:
        asked.append((secret, method, args))
        return len(args[0])

    channels = CallChannels(dispatch, 2, 5.0, hosts=lambda: frozenset({"127.0.0.1"}))
    with TcpCallListener("127.0.0.1") as listener:
        with pytest.raises(ShapeError, match="not the address of a node"):
            channels.open_remote("t", "s", "127.0.0.2", listener.port, listener.token)
        with pytest.raises(TransferTimeoutError):
            listener.accept_token(0.2)  # nothing connected
        channels.open_remote("t", "secret-t", "127.0.0.1", listener.port, listener.token)
        with listener.accept_token(10.0) as conn:
            send_frame(conn, pack_call("exists", (["a", "b"],)))
            assert unpack_reply(recv_frame(conn)) == 2
            send_frame(conn, pack_call("describe", ()))
            with pytest.raises(ShapeError):
                unpack_reply(recv_frame(conn))
    assert asked == [("secret-t", "exists", (["a", "b"],))]
    channels.close()
