"""A stand-in for ``RdmaPort`` where no RDMA device exists: the same methods, and a NIC that
checks what a real one checks before it moves a byte (a READ's remote key names a live
region that the whole range lies in; the local key one the destination lies in), then
copies. A refused READ completes with a remote access error, as on a real NIC; a queue
pair in the error state flushes what it is given. Both sides of a test share one
:class:`Fabric` (the wire)."""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from flatcake_ray.transports.rdma_port import Completion, RdmaEndpoint

REMOTE_ACCESS_ERROR = 10  # IBV_WC_REM_ACCESS_ERR
FLUSHED = 5  # IBV_WC_WR_FLUSH_ERR


class FakeVerbsError(Exception):
    pass


@dataclass
class Fabric:
    """Every live memory region, by key, and the READs posted (for the tests to see)."""

    regions: dict[int, tuple[int, int, bool]] = field(default_factory=dict)  # key -> span, remote
    keys: itertools.count = field(default_factory=lambda: itertools.count(0x1000, 7))
    reads: list[tuple[int, int]] = field(default_factory=list)  # (remote address, rkey)
    qp_numbers: itertools.count = field(default_factory=lambda: itertools.count(1))


class FakeRegion:
    def __init__(self, fabric: Fabric, buffer: np.ndarray, remote_read: bool) -> None:
        self.fabric = fabric
        self.lkey = self.rkey = next(fabric.keys)
        fabric.regions[self.rkey] = (buffer.ctypes.data, buffer.nbytes, remote_read)

    def close(self) -> None:
        self.fabric.regions.pop(self.rkey, None)


@dataclass
class FakeQP:
    qp_num: int
    failed: bool = False
    closed: bool = False

    def close(self) -> None:
        self.closed = True


class FakePort:
    def __init__(self, fabric: Fabric, max_message: int = 1 << 30) -> None:
        self.fabric = fabric
        self.errors: tuple[type[Exception], ...] = (FakeVerbsError,)
        self.enums = SimpleNamespace()
        self.max_message = max_message
        self._done: list[Completion] = []
        self.closed = False

    def endpoint(self, qp: FakeQP, psn: int, **exported) -> RdmaEndpoint:
        return RdmaEndpoint(qp.qp_num, psn, 0, "fake-gid", 5, **exported)

    def create_qp(self, max_send_wr: int) -> FakeQP:
        return FakeQP(next(self.fabric.qp_numbers))

    def connect(self, qp: FakeQP, local_psn: int, remote: RdmaEndpoint) -> None:
        pass

    def register(self, buffer: np.ndarray, *, remote_read: bool) -> FakeRegion:
        return FakeRegion(self.fabric, buffer, remote_read)

    def post_read(
        self, qp: FakeQP, wr_id: int, local: int, nbytes: int, lkey: int, remote: int, rkey: int
    ) -> None:
        self.fabric.reads.append((remote, rkey))
        if qp.failed:
            self._done.append(Completion(wr_id, False, f"status {FLUSHED}"))
            return
        if not (
            self._within(rkey, remote, nbytes, True) and self._within(lkey, local, nbytes, False)
        ):
            self._done.append(Completion(wr_id, False, f"status {REMOTE_ACCESS_ERROR}"))
            return
        ctypes.memmove(local, remote, nbytes)
        self._done.append(Completion(wr_id, True, ""))

    def _within(self, key: int, address: int, nbytes: int, remote: bool) -> bool:
        span = self.fabric.regions.get(key)
        if span is None or (remote and not span[2]):
            return False
        start, length, _ = span
        return start <= address and address + nbytes <= start + length

    def poll(self, most: int) -> list[Completion]:
        done, self._done = self._done[:most], self._done[most:]
        return done

    def to_error(self, qp: FakeQP) -> None:
        qp.failed = True

    def close(self) -> None:
        self.closed = True
