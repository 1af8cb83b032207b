"""The libibverbs plumbing (pyverbs) that both sides of one-sided RDMA use: an opened device
port (context, protection domain, completion queue), RC queue pairs, memory regions, and
the endpoint records the two sides swap out of band.

Everything the exporter (``rdma_export.py``) and the reader (``rdma_verbs.py``) ask of the
NIC goes through :class:`RdmaPort`, and nothing else imports pyverbs: a machine without an
RDMA device runs both sides over a recording stand-in with the same methods
(``tests/rdma_fake.py``), whose NIC checks a READ's remote key and bounds as a real one does.

Who calls what: the exporter ``register``s a memory region per arena chunk and, per reader,
``create_qp`` + ``connect`` + ``endpoint``; the reader ``register``s its destinations,
``post_read``s one work request per piece, ``poll``s completions, and on a failure
``to_error``s its queue pair (flushing what is outstanding). ``close`` frees all of it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from flatcake_ray.errors import TransportUnavailableError

_RD_ATOMIC = 16  # outstanding READs per QP, capped by what the device allows


@dataclass(frozen=True)
class RdmaRegion:
    """One exported chunk as a reader may READ it: its offset in the owner's arena, its
    length, and the remote key of its own memory region."""

    offset: int
    length: int
    rkey: int


@dataclass(frozen=True)
class RdmaEndpoint:
    """One side of an RC connection, exchanged out of band (picklable).

    The owner's side also says where its arena starts (``addr``), how long it is
    (``length``), and which of its chunks this reader may READ (``regions``: its tenant's,
    one memory region each); a reader sends none of them.
    """

    qp_num: int
    psn: int
    lid: int
    gid: str
    mtu: int
    addr: int = 0
    length: int = 0
    regions: tuple[RdmaRegion, ...] = ()


@dataclass(frozen=True)
class Completion:
    wr_id: int
    ok: bool
    detail: str  # status and vendor error of a failed one


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


def new_psn() -> int:
    return random.getrandbits(24)


class RdmaPort:
    """An opened device port: context, protection domain, completion queue and limits."""

    def __init__(self, device: str | None, port: int, gid_index: int, cq_depth: int) -> None:
        reason = rdma_probe()
        if reason is not None:
            raise TransportUnavailableError(reason)
        import pyverbs.device as dev
        import pyverbs.enums
        from pyverbs.cq import CQ
        from pyverbs.pd import PD
        from pyverbs.pyverbs_error import PyverbsError

        self.errors: tuple[type[Exception], ...] = (PyverbsError,)
        self.enums = pyverbs.enums
        name = device or dev.get_device_list()[0].name.decode()
        self.context = dev.Context(name=name)
        self.port = port
        self.gid_index = gid_index
        self.port_attr = self.context.query_port(port)
        self.device_attr = self.context.query_device()
        self.gid = str(self.context.query_gid(port, gid_index))
        self.max_message = int(self.port_attr.max_msg_sz)
        self.pd = PD(self.context)
        self.cq = CQ(self.context, cq_depth, None, None, 0)

    def endpoint(self, qp: Any, psn: int, **exported: Any) -> RdmaEndpoint:
        lid, mtu = self.port_attr.lid, self.port_attr.active_mtu
        return RdmaEndpoint(qp.qp_num, psn, lid, self.gid, mtu, **exported)

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

    def register(self, buffer: np.ndarray, *, remote_read: bool) -> Any:
        """A memory region over ``buffer`` (``.lkey``, ``.rkey``, ``.close()``): written by
        this NIC (a reader's destination), or read by peers' (``remote_read``)."""
        from pyverbs.mr import MR

        e = self.enums
        access = e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_REMOTE_READ if remote_read else 0)
        return MR(self.pd, buffer.nbytes, access, address=buffer.ctypes.data)

    def post_read(
        self, qp: Any, wr_id: int, local: int, nbytes: int, lkey: int, remote: int, rkey: int
    ) -> None:
        """Post one RDMA READ of ``nbytes`` at ``remote`` (under ``rkey``) to ``local``."""
        from pyverbs.wr import SGE, SendWR

        wr = SendWR(
            wr_id=wr_id,
            opcode=self.enums.IBV_WR_RDMA_READ,
            num_sge=1,
            sg=[SGE(local, nbytes, lkey)],
        )
        wr.set_wr_rdma(rkey, remote)
        qp.post_send(wr)

    def poll(self, most: int) -> list[Completion]:
        """The completions that arrived, at most ``most`` (none: an empty list)."""
        success = self.enums.IBV_WC_SUCCESS
        _, completions = self.cq.poll(most)
        return [
            Completion(
                wc.wr_id,
                wc.status == success,
                f"status {wc.status} (vendor error {wc.vendor_err})",
            )
            for wc in completions
        ]

    def to_error(self, qp: Any) -> None:
        """Move ``qp`` to the error state: every outstanding request is flushed."""
        from pyverbs.qp import QPAttr

        attr = QPAttr()
        attr.qp_state = self.enums.IBV_QPS_ERR
        qp.modify(attr, self.enums.IBV_QP_STATE)

    def close(self) -> None:
        self.context.close()  # closes the PD, CQ, QPs and MRs made from it
