"""Remote DRAM by one-sided RDMA READ over libibverbs (pyverbs), where an RDMA NIC exists.

Owner side: ``RdmaArenaExporter(arena)`` registers the arena as a memory region that remote
peers may READ. Each reader gets its own RC queue pair from ``accept(reader_endpoint)``.

Reader side: ``RdmaVerbsTransport()`` opens the device and creates its queue pair; the two
:class:`RdmaEndpoint` records (queue pair number, PSN, LID/GID, MTU, and on the owner's side
the region's address, length and rkey) are swapped out of band, e.g.::

    transport = RdmaVerbsTransport.connected(lambda mine: ray.get(node.accept_rdma.remote(mine)))

after which ``read`` posts one RDMA READ work request per range (long ranges split at the
port's message limit), keeps up to ``max_outstanding`` in flight, and polls the completion
queue. The owner's CPU takes no part in a read.

A failed or timed-out read moves the queue pair to the error state (which flushes every
outstanding request, so nothing writes into ``dst`` afterwards); the transport is then
broken and must be replaced by a new connection.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flatcake_ray.errors import (
    TransferError,
    TransferTimeoutError,
    TransportClosedError,
    TransportUnavailableError,
)
from flatcake_ray.transports.base import (
    REMOTE_DRAM_RDMA,
    ReadBatch,
    RegistrationCache,
    TransferStats,
    Transport,
)

DEFAULT_TIMEOUT_S = 30.0
_MAX_WR_BYTES = 1 << 30  # an SGE length is 32-bit; stay well inside it and max_msg_sz
_RD_ATOMIC = 16  # outstanding READs per QP, capped by what the device allows
_POLL_SLEEP_MAX_S = 0.001
_DRAIN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RdmaEndpoint:
    """One side of an RC connection, exchanged out of band (picklable).

    ``addr``/``length``/``rkey`` describe the exported region; a reader sends zeros there.
    """

    qp_num: int
    psn: int
    lid: int
    gid: str
    mtu: int
    addr: int = 0
    length: int = 0
    rkey: int = 0


def rdma_probe() -> str | None:
    """``None`` when pyverbs imports and sees at least one RDMA device, else why not."""
    try:
        import pyverbs.device as device
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as exc:
        return f"pyverbs not importable ({exc})"
    try:
        devices = device.get_device_list()
    except PyverbsError as exc:
        return f"no RDMA device (pyverbs: {exc})"  # libibverbs raises when it finds none
    if not devices:
        return "no RDMA device"
    return None


def split_ranges(reads: ReadBatch, limit: int) -> ReadBatch:
    """The same bytes as ranges of at most ``limit`` bytes each (order kept)."""
    counts = np.maximum(1, -(-reads.lengths // limit))
    if np.all(counts == 1):
        return reads
    owner = np.repeat(np.arange(len(reads)), counts)
    first_piece = np.repeat(np.cumsum(counts) - counts, counts)
    skip = (np.arange(owner.size) - first_piece) * limit
    lengths = np.minimum(limit, reads.lengths[owner] - skip)
    return ReadBatch(reads.src_offsets[owner] + skip, lengths, reads.dst_offsets[owner] + skip)


class _Port:
    """An opened device port: context, protection domain, completion queue and limits."""

    def __init__(self, device: str | None, port: int, gid_index: int, cq_depth: int) -> None:
        reason = rdma_probe()
        if reason is not None:
            raise TransportUnavailableError(reason)
        import pyverbs.device as dev
        import pyverbs.enums
        from pyverbs.cq import CQ
        from pyverbs.pd import PD

        self.enums = pyverbs.enums
        name = device or dev.get_device_list()[0].name.decode()
        self.context = dev.Context(name=name)
        self.port = port
        self.gid_index = gid_index
        self.port_attr = self.context.query_port(port)
        self.device_attr = self.context.query_device()
        self.gid = str(self.context.query_gid(port, gid_index))
        self.pd = PD(self.context)
        self.cq = CQ(self.context, cq_depth, None, None, 0)

    def endpoint(self, qp: Any, psn: int, **region: int) -> RdmaEndpoint:
        lid, mtu = self.port_attr.lid, self.port_attr.active_mtu
        return RdmaEndpoint(qp.qp_num, psn, lid, self.gid, mtu, **region)

    def create_qp(self, max_send_wr: int) -> Any:
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        e = self.enums
        cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=1)
        attr = QPAttr(port_num=self.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
        return QP(self.pd, init, attr)  # returned in INIT: RTR needs the peer's number

    def connect(self, qp: Any, local_psn: int, remote: RdmaEndpoint) -> None:
        """Move ``qp`` through RTR to RTS, aimed at ``remote``'s queue pair."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        e = self.enums
        attr = QPAttr(port_num=self.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
        attr.path_mtu = min(self.port_attr.active_mtu, remote.mtu)
        attr.dest_qp_num = remote.qp_num
        attr.rq_psn = remote.psn
        attr.sq_psn = local_psn
        attr.max_dest_rd_atomic = min(_RD_ATOMIC, self.device_attr.max_qp_rd_atom)
        attr.max_rd_atomic = min(_RD_ATOMIC, self.device_attr.max_qp_init_rd_atom)
        attr.min_rnr_timer = 12
        attr.timeout = 14  # 4.096 us * 2**14 = 67 ms per attempt
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        # A GRH is required on RoCE and harmless on InfiniBand.
        route = GlobalRoute(dgid=GID(remote.gid), sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(port_num=self.port, is_global=1, gr=route, dlid=remote.lid)
        qp.to_rts(attr)

    def register(self, buffer: np.ndarray, access: int) -> Any:
        from pyverbs.mr import MR

        return MR(self.pd, buffer.nbytes, access, address=buffer.ctypes.data)

    def close(self) -> None:
        self.context.close()  # closes the PD, CQ, QPs and MRs made from it


def _psn() -> int:
    return random.getrandbits(24)


class RdmaArenaExporter:
    """Owner side: the arena as a remotely readable memory region, one QP per reader."""

    def __init__(
        self, buffer: np.ndarray, *, device: str | None = None, port: int = 1, gid_index: int = 0
    ) -> None:
        self._buffer = buffer  # pinned by the MR until close
        self._port = _Port(device, port, gid_index, cq_depth=16)
        e = self._port.enums
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
        self._mr = self._port.register(buffer, access)
        self._qps: dict[tuple[str, int], Any] = {}

    def accept(self, reader: RdmaEndpoint) -> RdmaEndpoint:
        """Make a QP for ``reader`` and connect it; returns what the reader needs."""
        qp = self._port.create_qp(max_send_wr=1)  # the owner only answers READs
        psn = _psn()
        self._port.connect(qp, psn, reader)
        self._qps[(reader.gid, reader.qp_num)] = qp
        region = {"addr": self._buffer.ctypes.data, "length": self._buffer.nbytes}
        return self._port.endpoint(qp, psn, rkey=self._mr.rkey, **region)

    def renew(self) -> None:
        """Register the arena again: part of it was given a fresh file
        (``DramArena.renew_chunk``) and the old region pins the old pages. A reader's next
        READ with the old key fails (its transport is broken, its pages misses) and the
        client connects again (``accept``), with the new key."""
        e = self._port.enums
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
        old, self._mr = self._mr, self._port.register(self._buffer, access)
        old.close()

    def release(self, reader: RdmaEndpoint) -> None:
        """Drop a reader's QP (it closed, or died)."""
        qp = self._qps.pop((reader.gid, reader.qp_num), None)
        if qp is not None:
            qp.close()

    def close(self) -> None:
        try:
            for qp in self._qps.values():
                qp.close()  # before the MR: no READ may be answered from unregistered memory
            self._qps.clear()
            self._mr.close()
        finally:
            self._port.close()


class RdmaVerbsTransport(Transport):
    """Reader side: RDMA READs of a peer's exported arena into caller buffers.

    Destination buffers are registered as MRs on first use and cached by address range (see
    :class:`RegistrationCache`), so reuse one staging buffer across reads.
    """

    name = REMOTE_DRAM_RDMA

    def __init__(
        self,
        *,
        device: str | None = None,
        port: int = 1,
        gid_index: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_outstanding: int = 64,
        max_registrations: int = 8,
    ) -> None:
        if timeout_s <= 0 or max_outstanding < 1:
            raise ValueError("timeout_s must be positive and max_outstanding at least 1")
        self._port = _Port(device, port, gid_index, cq_depth=max_outstanding)
        self._window = max_outstanding
        self._qp = self._port.create_qp(max_send_wr=max_outstanding)
        self._psn = _psn()
        self._timeout_s = timeout_s
        self._peer: RdmaEndpoint | None = None
        self._broken: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._max_wr = min(_MAX_WR_BYTES, int(self._port.port_attr.max_msg_sz))
        access = self._port.enums.IBV_ACCESS_LOCAL_WRITE
        self._mrs = RegistrationCache(
            lambda buf: self._port.register(buf, access), lambda mr: mr.close(), max_registrations
        )

    @classmethod
    def probe(cls) -> str | None:
        return rdma_probe()

    @classmethod
    def connected(
        cls, accept: Callable[[RdmaEndpoint], RdmaEndpoint], **options: Any
    ) -> RdmaVerbsTransport:
        """Create, swap endpoints through ``accept`` (e.g. a Ray actor call), connect."""
        transport = cls(**options)
        try:
            transport.connect(accept(transport.local_endpoint()))
        except BaseException:
            transport.close()
            raise
        return transport

    @property
    def broken(self) -> bool:
        """True after a failed or timed-out read flushed the queue pair: reconnect."""
        return self._broken is not None

    def local_endpoint(self) -> RdmaEndpoint:
        return self._port.endpoint(self._qp, self._psn)

    def connect(self, peer: RdmaEndpoint) -> None:
        if peer.rkey == 0 or peer.length == 0:
            raise ValueError("the peer endpoint exports no memory region")
        self._port.connect(self._qp, self._psn, peer)
        self._peer = peer

    def read(self, reads: ReadBatch, dst: np.ndarray) -> TransferStats:
        peer = self._usable_peer()
        reads.check_destination(dst)
        reads.check_source(peer.length, f"the RDMA region of QP {peer.qp_num}")
        pieces = split_ranges(reads.nonempty(), self._max_wr)
        start = time.perf_counter()
        if len(pieces):
            from pyverbs.pyverbs_error import PyverbsError

            try:
                with self._lock, self._mrs.use(dst) as mr:
                    self._run(pieces, dst, mr, peer, time.monotonic() + self._timeout_s)
            except PyverbsError as exc:  # registering dst, posting, polling
                raise TransferError(f"RDMA READ failed: {exc}") from exc
        elapsed = time.perf_counter() - start
        return TransferStats(reads.total_bytes, len(pieces), elapsed, self.name)

    def _usable_peer(self) -> RdmaEndpoint:
        if self._closed:
            raise TransportClosedError("RDMA transport is closed")
        if self._broken is not None:
            raise TransferError(f"RDMA connection is broken ({self._broken}); reconnect")
        if self._peer is None:
            raise TransferError("RDMA transport is not connected; call connect() first")
        return self._peer

    def _run(
        self, pieces: ReadBatch, dst: np.ndarray, mr: Any, peer: RdmaEndpoint, deadline: float
    ) -> None:
        posted = done = 0
        try:
            while done < len(pieces):
                while posted < len(pieces) and posted - done < self._window:
                    self._post(pieces, posted, dst, mr, peer)
                    posted += 1
                arrived, failure = self._reap(posted - done, deadline)
                done += arrived
                if failure:
                    raise TransferError(failure)
        except BaseException as exc:
            self._abort(posted - done, reason=type(exc).__name__)
            raise

    def _post(
        self, pieces: ReadBatch, i: int, dst: np.ndarray, mr: Any, peer: RdmaEndpoint
    ) -> None:
        from pyverbs.wr import SGE, SendWR

        e = self._port.enums
        local = dst.ctypes.data + int(pieces.dst_offsets[i])
        sge = SGE(local, int(pieces.lengths[i]), mr.lkey)
        wr = SendWR(wr_id=i, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[sge])
        wr.set_wr_rdma(peer.rkey, peer.addr + int(pieces.src_offsets[i]))
        self._qp.post_send(wr)

    def _reap(self, outstanding: int, deadline: float) -> tuple[int, str]:
        """Wait for at least one completion; return how many arrived and the first failure."""
        success = self._port.enums.IBV_WC_SUCCESS
        pause = 0.0
        while True:
            count, completions = self._port.cq.poll(outstanding)
            failed = [wc for wc in completions if wc.status != success]
            if failed:
                wc = failed[0]
                return count, (
                    f"RDMA READ {wc.wr_id} completed with status {wc.status} "
                    f"(vendor error {wc.vendor_err})"
                )
            if count:
                return count, ""
            if time.monotonic() > deadline:
                raise TransferTimeoutError("RDMA READ did not complete before its deadline")
            if pause:
                time.sleep(pause)
            pause = min(_POLL_SLEEP_MAX_S, pause * 2 or 1e-5)

    def _abort(self, outstanding: int, reason: str) -> None:
        """Flush the QP so no request can still write into the destination; mark it broken."""
        from pyverbs.qp import QPAttr

        e = self._port.enums
        self._broken = reason
        attr = QPAttr()
        attr.qp_state = e.IBV_QPS_ERR
        self._qp.modify(attr, e.IBV_QP_STATE)
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        while outstanding > 0 and time.monotonic() < deadline:
            count, _ = self._port.cq.poll(outstanding)  # flushed requests, statuses moot
            outstanding -= count
            time.sleep(0 if count else _POLL_SLEEP_MAX_S)
        # Requests still unflushed keep their MR (and through it ``dst``) alive in the
        # registration cache; close() destroys the QP before any MR, which stops them.

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._qp.close()  # first: no request may outlive the MRs it writes through
            self._mrs.clear()
        finally:
            self._port.close()
