"""Remote DRAM by one-sided RDMA READ over libibverbs (pyverbs), where an RDMA NIC exists.

Owner side: ``RdmaArenaExporter`` (``rdma_export.py``) registers the arena a chunk at a
time as memory regions peers may READ, and gives each reader the keys of its tenant's
chunks only. Reader side: ``RdmaVerbsTransport()`` opens the device and creates its queue
pair; the two :class:`RdmaEndpoint` records (queue pair number, PSN, LID/GID, MTU, and on the
owner's side the arena's address and the reader's regions) are swapped out of band, e.g.::

    transport = RdmaVerbsTransport.connected(lambda mine: ray.get(node.accept_rdma.remote(mine)))

after which ``read`` posts one RDMA READ work request per piece (ranges cut at chunk
borders, a region each, and at the port's message limit), keeps up to ``max_outstanding``
in flight, and polls the completion queue. The owner's CPU takes no part in a read. A read
that reaches past the regions it was given asks ``refresh`` once for those its tenant holds
now (it may have taken more since), then is :class:`ForeignMemoryError` (a miss).

A failed or timed-out read moves the queue pair to the error state (which flushes every
outstanding request, so nothing writes into ``dst`` afterwards); the transport is then
broken and must be replaced by a new connection.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from flatcake_ray.errors import (
    ForeignMemoryError,
    TransferError,
    TransferTimeoutError,
    TransportClosedError,
)
from flatcake_ray.transports.base import (
    REMOTE_DRAM_RDMA,
    ReadBatch,
    RegistrationCache,
    TransferStats,
    Transport,
)
from flatcake_ray.transports.local_dram import split_at
from flatcake_ray.transports.rdma_port import (
    RdmaEndpoint,
    RdmaPort,
    RdmaRegion,
    new_psn,
    rdma_probe,
)

__all__ = [
    "RdmaEndpoint",
    "RdmaRegion",
    "RdmaVerbsTransport",
    "placed",
    "rdma_probe",
    "split_ranges",
]

DEFAULT_TIMEOUT_S = 30.0
_MAX_WR_BYTES = 1 << 30  # an SGE length is 32-bit; stay well inside it and max_msg_sz
_POLL_SLEEP_MAX_S = 0.001
_DRAIN_TIMEOUT_S = 5.0


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


def placed(
    reads: ReadBatch, regions: tuple[RdmaRegion, ...], limit: int
) -> tuple[ReadBatch, np.ndarray] | None:
    """The pieces to post for ``reads`` (cut at region borders and at ``limit`` bytes) and
    the remote key of each; None when a piece lies outside every region."""
    if not regions:
        return None if len(reads) else (reads, np.zeros(0, np.int64))
    regions = tuple(sorted(regions, key=lambda region: region.offset))
    starts = np.array([r.offset for r in regions], dtype=np.int64)
    ends = starts + np.array([r.length for r in regions], dtype=np.int64)
    pieces = split_ranges(split_at(reads, starts[1:]), limit)
    index = np.searchsorted(starts, pieces.src_offsets, side="right") - 1
    inside = (index >= 0) & (pieces.src_offsets + pieces.lengths <= ends[np.maximum(index, 0)])
    if not inside.all():
        return None
    keys = np.array([r.rkey for r in regions], dtype=np.int64)
    return pieces, keys[index]


class RdmaVerbsTransport(Transport):
    """Reader side: RDMA READs of a peer's exported arena chunks into caller buffers.

    Destination buffers are registered as MRs on first use and cached by address range (see
    :class:`RegistrationCache`), so reuse one staging buffer across reads. ``port``: an
    opened :class:`RdmaPort` (or a stand-in with its methods); by default ``device``'s.
    ``refresh``: the regions the peer exports to this reader now (asked once when a read
    reaches past those it knows).
    """

    name = REMOTE_DRAM_RDMA

    def __init__(
        self,
        *,
        device: str | None = None,
        port: Any = None,
        gid_index: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_outstanding: int = 64,
        max_registrations: int = 8,
        refresh: Callable[[], tuple[RdmaRegion, ...]] | None = None,
    ) -> None:
        if timeout_s <= 0 or max_outstanding < 1:
            raise ValueError("timeout_s must be positive and max_outstanding at least 1")
        self._port = port if port is not None else RdmaPort(device, 1, gid_index, max_outstanding)
        self._window = max_outstanding
        self._qp = self._port.create_qp(max_send_wr=max_outstanding)
        self._psn = new_psn()
        self._timeout_s = timeout_s
        self._peer: RdmaEndpoint | None = None
        self._refresh = refresh
        self._broken: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._max_wr = min(_MAX_WR_BYTES, self._port.max_message)
        self._mrs = RegistrationCache(
            lambda buf: self._port.register(buf, remote_read=False),
            lambda mr: mr.close(),
            max_registrations,
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
        if peer.length == 0:
            raise ValueError("the peer endpoint exports no memory")
        self._port.connect(self._qp, self._psn, peer)
        self._peer = peer

    def read(self, reads: ReadBatch, dst: np.ndarray) -> TransferStats:
        peer = self._usable_peer()
        reads.check_destination(dst)
        reads.check_source(peer.length, f"the RDMA arena of QP {peer.qp_num}")
        pieces, keys = self._placed(reads.nonempty())
        start = time.perf_counter()
        if len(pieces):
            try:
                with self._lock, self._mrs.use(dst) as mr:
                    self._run(pieces, keys, dst, mr, time.monotonic() + self._timeout_s)
            except self._port.errors as exc:  # registering dst, posting, polling
                raise TransferError(f"RDMA READ failed: {exc}") from exc
        elapsed = time.perf_counter() - start
        return TransferStats(reads.total_bytes, len(pieces), elapsed, self.name)

    def _placed(self, reads: ReadBatch) -> tuple[ReadBatch, np.ndarray]:
        assert self._peer is not None
        found = placed(reads, self._peer.regions, self._max_wr)
        if found is None and self._refresh is not None:
            self._peer = replace(self._peer, regions=self._refresh())
            found = placed(reads, self._peer.regions, self._max_wr)
        if found is None:
            raise ForeignMemoryError("a range outside the arena chunks exported to this tenant")
        return found

    def _usable_peer(self) -> RdmaEndpoint:
        if self._closed:
            raise TransportClosedError("RDMA transport is closed")
        if self._broken is not None:
            raise TransferError(f"RDMA connection is broken ({self._broken}); reconnect")
        if self._peer is None:
            raise TransferError("RDMA transport is not connected; call connect() first")
        return self._peer

    def _run(
        self, pieces: ReadBatch, keys: np.ndarray, dst: np.ndarray, mr: Any, deadline: float
    ) -> None:
        assert self._peer is not None
        base, local = self._peer.addr, dst.ctypes.data
        posted = done = 0
        try:
            while done < len(pieces):
                while posted < len(pieces) and posted - done < self._window:
                    self._port.post_read(
                        self._qp,
                        posted,
                        local + int(pieces.dst_offsets[posted]),
                        int(pieces.lengths[posted]),
                        mr.lkey,
                        base + int(pieces.src_offsets[posted]),
                        int(keys[posted]),
                    )
                    posted += 1
                arrived, failure = self._reap(posted - done, deadline)
                done += arrived
                if failure:
                    raise TransferError(failure)
        except BaseException as exc:
            self._abort(posted - done, reason=type(exc).__name__)
            raise

    def _reap(self, outstanding: int, deadline: float) -> tuple[int, str]:
        """Wait for at least one completion; return how many arrived and the first failure."""
        pause = 0.0
        while True:
            completions = self._port.poll(outstanding)
            failed = [c for c in completions if not c.ok]
            if failed:
                return len(
                    completions
                ), f"RDMA READ {failed[0].wr_id} completed with {failed[0].detail}"
            if completions:
                return len(completions), ""
            if time.monotonic() > deadline:
                raise TransferTimeoutError("RDMA READ did not complete before its deadline")
            if pause:
                time.sleep(pause)
            pause = min(_POLL_SLEEP_MAX_S, pause * 2 or 1e-5)

    def _abort(self, outstanding: int, reason: str) -> None:
        """Flush the QP so no request can still write into the destination; mark it broken."""
        self._broken = reason
        self._port.to_error(self._qp)
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        while outstanding > 0 and time.monotonic() < deadline:
            count = len(self._port.poll(outstanding))  # flushed requests, statuses moot
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
