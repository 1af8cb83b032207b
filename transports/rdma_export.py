"""The owner's side of one-sided RDMA: the arena as memory regions that peers READ, one per
chunk, and one RC queue pair per reader.

A reader is given the remote keys of the chunks its tenant holds and of no other
(``accept(reader, offsets)``, ``regions(offsets)``), so its NIC cannot READ another
tenant's chunk: the owner's NIC refuses a key it was not given, or a range past the region
it names (issue 23; the whole arena as one region, as this once was, handed every tenant
every tenant's DRAM). A chunk that changes tenants is given a fresh file
(``DramArena.renew_chunk``) and registered again (:meth:`RdmaArenaExporter.renew`): the
former tenant's key dies with the old region, and only that chunk's readers see a failed
READ (a miss) and ask for its new key.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from flatcake_ray.transports.rdma_port import RdmaEndpoint, RdmaPort, RdmaRegion, new_psn


class RdmaArenaExporter:
    """Owner side: ``buffer`` as remotely readable memory regions of ``chunk_bytes`` each
    (0: one region), one QP per reader. ``port``: an opened :class:`RdmaPort` (or a
    stand-in with its methods); by default the first device's port 1."""

    def __init__(
        self,
        buffer: np.ndarray,
        *,
        chunk_bytes: int = 0,
        port: Any = None,
        device: str | None = None,
        gid_index: int = 0,
    ) -> None:
        self._buffer = buffer  # pinned by the regions until close
        self.chunk_bytes = chunk_bytes or max(buffer.nbytes, 1)
        self._port = port if port is not None else RdmaPort(device, 1, gid_index, cq_depth=16)
        self._regions: dict[int, Any] = {}  # chunk offset -> its memory region
        self._qps: dict[tuple[str, int], Any] = {}
        try:
            for offset in range(0, buffer.nbytes, self.chunk_bytes):
                self._regions[offset] = self._register(offset)
        except BaseException:
            self.close()
            raise

    def _register(self, offset: int) -> Any:
        chunk = self._buffer[offset : offset + self.chunk_bytes]
        return self._port.register(chunk, remote_read=True)

    def regions(self, offsets: Iterable[int]) -> tuple[RdmaRegion, ...]:
        """The chunks that start at ``offsets`` as a reader may READ them (unknown offsets
        are left out)."""
        wanted = sorted(o for o in set(offsets) if o in self._regions)
        return tuple(
            RdmaRegion(o, min(self.chunk_bytes, self._buffer.nbytes - o), self._regions[o].rkey)
            for o in wanted
        )

    def accept(self, reader: RdmaEndpoint, offsets: Iterable[int]) -> RdmaEndpoint:
        """Make a QP for ``reader`` and connect it; returns what the reader needs to READ
        the chunks at ``offsets`` (its tenant's), and nothing else."""
        qp = self._port.create_qp(max_send_wr=1)  # the owner only answers READs
        psn = new_psn()
        self._port.connect(qp, psn, reader)
        self._qps[(reader.gid, reader.qp_num)] = qp
        base, length = self._buffer.ctypes.data, self._buffer.nbytes
        return self._port.endpoint(qp, psn, addr=base, length=length, regions=self.regions(offsets))

    def renew(self, offset: int) -> None:
        """Register the chunk at ``offset`` again: it was given a fresh file and its region
        pins the old pages. Readers holding the old key fail their next READ there once (the
        transport breaks, its pages are misses) and connect again, with the new key."""
        old = self._regions.pop(offset)
        try:
            old.close()
        finally:
            self._regions[offset] = self._register(offset)

    def release(self, reader: RdmaEndpoint) -> None:
        """Drop a reader's QP (it closed, or died)."""
        qp = self._qps.pop((reader.gid, reader.qp_num), None)
        if qp is not None:
            qp.close()

    def close(self) -> None:
        try:
            for qp in self._qps.values():
                qp.close()  # before the regions: no READ may be answered from unregistered memory
            self._qps.clear()
            for region in self._regions.values():
                region.close()
            self._regions.clear()
        finally:
            self._port.close()
