"""A storage node's answers that carry bytes of leased ranges: shipped SSD reads (one window
a call, or a whole restore streamed) and the labelled object-store fallback.

Every range named must lie in a lease the caller's tenant holds (checked again right before
each streamed window is read: a lease may lapse mid-stream), and a reply is bounded by
``ship_bytes``. ``StorageNode`` checks the caller and hands the tenant's name in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from flatcake_ray.actors.shipping import ShipBuffer, ShipReply
from flatcake_ray.actors.wire import check_ranges, check_windows
from flatcake_ray.config import ServiceConfig
from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import ReadRangeError
from flatcake_ray.transports.base import ReadBatch
from flatcake_ray.transports.local_dram import LocalDramTransport


class LeasedBytes:
    def __init__(
        self,
        config: ServiceConfig,
        ship_buffer: ShipBuffer,
        allowed_ranges: Callable[[str, Medium], Any],
        arena_view: Callable[[], np.ndarray],
        counters: dict[str, int],
    ) -> None:
        self._config = config
        self._ship_buffer = ship_buffer
        self._allowed_ranges = allowed_ranges  # (tenant, medium) -> its leased runs
        self._arena_view = arena_view
        self._counters = counters

    def leased(self, tenant: str, medium: Medium, offsets: Any, lengths: Any) -> ReadBatch:
        """The packed reads of ranges ``tenant`` holds leases on (at most ``ship_bytes``)."""
        src, sizes = check_ranges(offsets, lengths, self._config.ship_bytes)
        allowed = self._allowed_ranges(tenant, medium)
        for start, length in zip(src.tolist(), sizes.tolist(), strict=True):
            if not allowed.covers(start, length):
                self._counters["ranges_refused"] += 1
                raise ReadRangeError(
                    f"{medium.name} range {start}+{length} is in no lease this tenant holds"
                )
        return ReadBatch.packed(src, sizes)

    def ship(self, tenant: str, src_offsets: Any, lengths: Any) -> ShipReply:
        batch = self.leased(tenant, Medium.SSD, src_offsets, lengths)
        return self._ship_buffer.ship(batch.src_offsets, batch.lengths, tenant)

    def stream(
        self, tenant: str, stream_id: object, src_offsets: Any, lengths: Any, counts: Any
    ) -> Iterator[ShipReply]:
        if not isinstance(stream_id, int) or isinstance(stream_id, bool):
            raise ReadRangeError("a stream id is an int")
        windows = check_windows(src_offsets, lengths, counts, self._config.ship_bytes // 2)

        def check(src: np.ndarray, sizes: np.ndarray) -> None:
            self.leased(tenant, Medium.SSD, src, sizes)

        timeout = self._config.rpc_timeout_s
        yield from self._ship_buffer.stream(windows, tenant, stream_id, timeout, check)

    def read_ranges(self, tenant: str, medium: Any, src_offsets: Any, lengths: Any) -> np.ndarray:
        known = (int(Medium.DRAM), int(Medium.SSD))  # an int first: an array has no truth
        if not isinstance(medium, int) or isinstance(medium, bool) or medium not in known:
            raise ReadRangeError(f"no medium {medium!r}")
        batch = self.leased(tenant, Medium(medium), src_offsets, lengths)
        self._counters["fallback_reads"] += 1
        if Medium(medium) is Medium.SSD:
            return self._ship_buffer.read_ssd(batch.src_offsets, batch.lengths)
        out = np.empty(batch.total_bytes, dtype=np.uint8)
        LocalDramTransport(self._arena_view()).read(batch, out)
        return out


class LeasedBytesCalls:
    """The StorageNode calls that serve bytes of leased ranges: shipped SSD reads and the
    object-store fallback (mixed into ``StorageNode``, which provides ``_tenant``,
    ``exports``, ``leased_bytes`` and ``ship_buffer``)."""

    exports: Any
    leased_bytes: LeasedBytes
    ship_buffer: ShipBuffer

    def _tenant(self, secret: object, *, metered: bool = True) -> Any:
        raise NotImplementedError

    def ship(self, secret: object, src_offsets: Any, lengths: Any) -> ShipReply:
        self.exports.wake()  # before: the region is read as soon as the reply lands
        return self.leased_bytes.ship(self._tenant(secret).name, src_offsets, lengths)

    def unship(self, secret: object, region_id: object) -> bool:
        return self.ship_buffer.unship(region_id, self._tenant(secret, metered=False).name)

    def ship_stream(
        self, secret: object, stream_id: object, src_offsets: Any, lengths: Any, counts: Any
    ) -> Iterator[ShipReply]:
        """A Ray streaming generator: a whole restore's windows (``counts[i]`` ranges each),
        each yielded as soon as it is read into a region (see ``ShipBuffer.stream``)."""
        tenant = self._tenant(secret).name
        self.exports.wake()
        yield from self.leased_bytes.stream(tenant, stream_id, src_offsets, lengths, counts)

    def ship_stop(self, secret: object, stream_id: object) -> None:
        tenant = self._tenant(secret, metered=False).name
        if isinstance(stream_id, int) and not isinstance(stream_id, bool):
            self.ship_buffer.stop(tenant, stream_id)

    def read_ranges(
        self, secret: object, medium: Any, src_offsets: Any, lengths: Any
    ) -> np.ndarray:
        """LAST RESORT (object-store fallback): the ranges' bytes, packed, as the reply."""
        tenant = self._tenant(secret).name
        return self.leased_bytes.read_ranges(tenant, medium, src_offsets, lengths)
