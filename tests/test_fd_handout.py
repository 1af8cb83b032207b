"""Handing memory to a client as descriptors (issue 23): the client takes chunks only from
the node's process, a node hands a tenant only the chunks that tenant holds, and nothing
else is sent or left open."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from flatcake_ray.actors.landing import LandingArea
from flatcake_ray.actors.memory_handout import MemoryHandout
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.tenants import Tenant, new_secret, secret_hash
from flatcake_ray.errors import ForeignMemoryError, ShapeError, TransferTimeoutError
from flatcake_ray.media.fd_handout import ChunkReceiver, send_chunks
from tests.conftest import LAYERS, PAGE_BYTES, random_kv
from tests.same_user import opened_of_a_target

CHUNK = 256 << 10
DRAM = PutHints(turn=2, prior_reply_tokens=1)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def memfd():
    """A chunk-like memfd whose first bytes say who made it."""
    made: list[int] = []

    def make(label: bytes) -> int:
        fd = os.memfd_create("handout-test", os.MFD_CLOEXEC)
        os.ftruncate(fd, CHUNK)
        os.pwrite(fd, label, 0)
        made.append(fd)
        return fd

    yield make
    for fd in made:
        os.close(fd)


def first_bytes(fd: int, count: int) -> bytes:
    return os.pread(fd, count, 0)


def test_a_handout_arrives_whole_and_from_the_sender_only(memfd):
    real = memfd(b"the node's")
    # An impostor of this machine found the socket's name and connects first, sending a
    # descriptor of its own memory: the receiver drops it unread.
    impostor = (
        "import os, socket, sys\n"
        "fd = os.memfd_create('fake', 0); os.ftruncate(fd, 4096); os.pwrite(fd, b'garbage', 0)\n"
        "with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:\n"
        "    sock.connect('\\0' + sys.argv[1])\n"
        "    header = (0).to_bytes(8, 'little') + (4096).to_bytes(8, 'little')\n"
        "    socket.send_fds(sock, [header], [fd])\n"
    )
    before = open_fds()
    with ChunkReceiver() as receiver:
        subprocess.run([sys.executable, "-c", impostor, receiver.name], check=True, timeout=60)
        send_chunks(receiver.name, [(3 * CHUNK, CHUNK, real)], timeout_s=5.0)
        (chunk,) = receiver.receive(os.getpid(), 1, timeout_s=5.0)
    try:
        assert (chunk.offset, chunk.nbytes) == (3 * CHUNK, CHUNK)
        assert first_bytes(chunk.fd, 10) == b"the node's"
        assert os.fstat(chunk.fd).st_ino == os.fstat(real).st_ino  # the same memory
    finally:
        os.close(chunk.fd)
    assert open_fds() == before  # the impostor's descriptor was closed, the socket too


def test_no_handout_times_out_and_bad_names_are_refused(memfd):
    with ChunkReceiver() as receiver, pytest.raises(TransferTimeoutError):
        receiver.receive(os.getpid(), 1, timeout_s=0.2)
    fd = memfd(b"x")
    for name in ("", "/dev/shm/flatcake-x", "flatcake-fd-" + "g" * 32, 7):
        with pytest.raises(ShapeError):
            send_chunks(name, [(0, CHUNK, fd)], timeout_s=1.0)  # type: ignore[arg-type]
    with ChunkReceiver() as gone:
        name = gone.name
    with pytest.raises(ForeignMemoryError, match="no process"):  # a well-formed name, unheard
        send_chunks(name, [(0, CHUNK, fd)], timeout_s=1.0)


@pytest.fixture
def handout(make_store):
    store = make_store(dram_bytes=4 * CHUNK, dram_chunks=4)
    for name in ("alpha", "beta"):
        store.set_tenant(Tenant(name, secret_hash(new_secret()), LAYERS, PAGE_BYTES))
        store.put([f"{name}/{i}" for i in range(2)], random_kv(2), tenant=name, hints=DRAM)
    landing = LandingArea(4 * CHUNK, f"handout-test-{os.getpid()}", chunks=4)
    yield store, landing, MemoryHandout(store, landing, timeout_s=5.0)
    landing.close()


def hand(handout: MemoryHandout, tenant: str, memory: object, offsets=None) -> list:
    with ChunkReceiver() as receiver:
        count = handout.hand(tenant, receiver.name, memory, offsets)
        return receiver.receive(os.getpid(), count, timeout_s=5.0)


def test_a_tenant_is_handed_the_chunks_it_holds_and_no_other(handout):
    store, landing, memory = handout
    alpha, beta = store.arena_chunks("alpha"), store.arena_chunks("beta")
    chunks = hand(memory, "alpha", "arena")
    try:
        assert [(c.offset, c.nbytes) for c in chunks] == [(c.offset, c.nbytes) for c in alpha]
        (chunk,) = chunks
        gva = int(store.gvas(["alpha/0"], tenant="alpha")[0])
        page = os.pread(chunk.fd, PAGE_BYTES, gva - chunk.offset)
        stored = store.arena.view[gva : gva + PAGE_BYTES]
        assert np.array_equal(np.frombuffer(page, np.uint8), stored)
    finally:
        for chunk in chunks:
            os.close(chunk.fd)
    before = open_fds()
    with pytest.raises(ForeignMemoryError):  # beta's chunk, asked for by offset
        hand(memory, "alpha", "arena", [beta[0].offset])
    with pytest.raises(ForeignMemoryError):  # past its own chunk: no chunk starts there
        hand(memory, "alpha", "arena", [alpha[0].offset + 4096])
    assert hand(memory, "gamma", "arena") == []  # a tenant that holds nothing gets nothing
    for bad in ("disk", None, 3):
        with pytest.raises(ShapeError):
            hand(memory, "alpha", bad)
    with pytest.raises(ShapeError):
        hand(memory, "alpha", "arena", "0")
    assert open_fds() == before
    region, at = landing.take(CHUNK // 2, "beta")
    (slots,) = landing.chunks_of("beta")
    with pytest.raises(ForeignMemoryError):  # beta's landing slots: not alpha's to write
        hand(memory, "alpha", "landing", [slots.offset])
    (theirs,) = hand(memory, "beta", "landing", [slots.offset])
    os.close(theirs.fd)
    assert theirs.offset <= at < theirs.offset + theirs.nbytes
    landing.give(region, "beta")


def test_a_private_process_is_closed_to_its_own_user_and_a_dumpable_one_is_not():
    """What ``keep_memory_private`` (every storage node, ``private_node_memory``) closes: a
    process of the same user opens a dumpable one's memory and descriptors (a memfd among
    them) through ``/proc``, and nothing of a private one."""
    dumpable = opened_of_a_target(private=False)
    assert "mem" in dumpable and any(name.startswith("fd/") for name in dumpable)
    assert opened_of_a_target(private=True) == []


def test_private_node_memory_comes_from_every_source(tmp_path):
    from flatcake_ray.cli import build_parser
    from flatcake_ray.cli.service import config_from_args
    from flatcake_ray.config import ServiceConfig
    from flatcake_ray.errors import ConfigError

    assert ServiceConfig().private_node_memory is True
    assert (
        ServiceConfig.from_env({"FLATCAKE_PRIVATE_NODE_MEMORY": "0"}).private_node_memory is False
    )
    with pytest.raises(ConfigError, match="FLATCAKE_PRIVATE_NODE_MEMORY"):
        ServiceConfig.from_env({"FLATCAKE_PRIVATE_NODE_MEMORY": "sometimes"})
    parsed = build_parser().parse_args(["start", "--debuggable-nodes"])
    assert config_from_args(parsed).private_node_memory is False
    assert config_from_args(build_parser().parse_args(["start"])).private_node_memory is True
    config_file = tmp_path / "service.json"
    config_file.write_text('{"private_node_memory": false}')
    parsed = build_parser().parse_args(["start", "--config", str(config_file)])
    assert config_from_args(parsed).private_node_memory is False


def test_a_handout_of_many_chunks_arrives_whole_in_several_messages():
    """More chunks than one message carries (a tenant holding many chunks of a big arena)."""
    made = [os.memfd_create(f"many-{i}", os.MFD_CLOEXEC) for i in range(300)]
    try:
        with ChunkReceiver() as receiver:
            send_chunks(receiver.name, [(i * CHUNK, CHUNK, fd) for i, fd in enumerate(made)], 5.0)
            chunks = receiver.receive(os.getpid(), len(made), timeout_s=5.0)
        assert [c.offset for c in chunks] == [i * CHUNK for i in range(300)]
        for chunk, fd in zip(chunks, made, strict=True):
            assert os.fstat(chunk.fd).st_ino == os.fstat(fd).st_ino
            os.close(chunk.fd)
    finally:
        for fd in made:
            os.close(fd)
