"""The reader's side of a streamed shipped SSD read (``remote-ssd-shipped``, read ahead).

One ``ship_stream`` call names every window of a restore's remote SSD chunks; the owner reads
them from its SSD one after another into regions of its ship buffer and yields each region
as soon as it is filled (``actors/shipping.py``). This side takes the replies in order, fetches
each region with one NIXL READ and frees it with a fire-and-forget ``unship``. The owner's
reads therefore run ahead of the fetches and of the pipeline's scatter, bounded by its buffer,
and a window costs no request round trip: one call per restore instead of one per window.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from typing import Any, Protocol

import numpy as np

from flatcake_ray.errors import (
    PeerDisconnectedError,
    ReadRangeError,
    TransferError,
    TransferTimeoutError,
)
from flatcake_ray.transports.base import ReadBatch, ReadStream, TransferStats


class ShipOwner(Protocol):
    """What a stream asks of the transport that opened it
    (:class:`~flatcake_ray.transports.remote_ssd.ShippedSsdTransport`)."""

    @property
    def name(self) -> str: ...

    @property
    def timeout_s(self) -> float: ...

    def windows(self, reads: ReadBatch) -> list[ReadBatch]: ...

    def call(self, method: str, *args: Any) -> Any: ...

    def fetch(self, window: ReadBatch, dst: np.ndarray, region: int) -> TransferStats: ...

    def unship(self, region_id: int) -> None: ...


log = logging.getLogger(__name__)


def same_batch(a: ReadBatch, b: ReadBatch) -> bool:
    return all(
        np.array_equal(x, y)
        for x, y in (
            (a.src_offsets, b.src_offsets),
            (a.lengths, b.lengths),
            (a.dst_offsets, b.dst_offsets),
        )
    )


class ShipStream(ReadStream):
    """See the module docstring; made by :meth:`ShippedSsdTransport.open_stream`."""

    def __init__(
        self, transport: ShipOwner, batches: list[ReadBatch], lock: threading.Lock
    ) -> None:
        self._transport = transport
        self._lock = lock  # the caller's lock of this transport: held around each fetch
        self._pending: deque[tuple[ReadBatch, list[ReadBatch]]] = deque()
        windows: list[ReadBatch] = []
        for batch in batches:
            cut = transport.windows(batch.nonempty())
            self._pending.append((batch, cut))
            windows.extend(cut)
        self._left = len(windows)  # windows the owner will yield that were not taken yet
        self._broken: BaseException | None = None
        self._stream_id = secrets.randbits(63)
        self._replies: Any = None
        self.actor_calls = 0  # calls to the owner this stream made (the opening one too)
        if windows:
            self._replies = self._call(
                "ship_stream",
                self._stream_id,
                np.concatenate([w.src_offsets for w in windows]),
                np.concatenate([w.lengths for w in windows]),
                [len(w) for w in windows],
            )

    def read_next(self, reads: ReadBatch, dst: np.ndarray) -> TransferStats:
        if self._broken is not None:
            raise TransferError(f"the shipped stream broke earlier: {self._broken}")
        if not self._pending or not same_batch(self._pending[0][0], reads):
            raise ReadRangeError("a streamed read must be the next batch announced")
        reads.check_destination(dst)
        _, windows = self._pending.popleft()
        start, commands = time.perf_counter(), 0
        try:
            for window in windows:
                reply = self._next_reply()
                try:
                    with self._lock:
                        fetched = self._transport.fetch(window, dst, reply.offset)
                    commands += reply.io_commands + fetched.commands
                finally:
                    self._unship(reply.region_id)
        except BaseException as exc:
            self._broken = exc
            raise
        return TransferStats(
            reads.total_bytes, commands, time.perf_counter() - start, self._transport.name
        )

    def _call(self, method: str, *args: Any) -> Any:
        self.actor_calls += 1
        return self._transport.call(method, *args)

    def _unship(self, region_id: int) -> None:
        self.actor_calls += 1
        self._transport.unship(region_id)

    def _next_reply(self) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        timeout = self._transport.timeout_s
        try:
            ready, _ = ray.wait([self._replies], timeout=timeout)
            if not ready:
                raise TransferTimeoutError(f"the owner shipped nothing for {timeout}s")
            ref = next(self._replies)
            self._left -= 1
            return ray.get(ref, timeout=timeout)
        except StopIteration:
            raise TransferError("the owner ended the stream early") from None
        except GetTimeoutError as exc:
            raise TransferTimeoutError(f"the owner did not ship in {timeout}s") from exc
        except RayActorError as exc:
            raise PeerDisconnectedError(f"the owner of the SSD pages is gone: {exc}") from exc

    def close(self) -> None:
        replies, self._replies = self._replies, None
        if replies is None or self._left <= 0:
            return
        # Stopped early: the owner yields nothing more, and what it did yield is ours to free.
        from ray.exceptions import RayError

        self._call("ship_stop", self._stream_id)
        self._replies = replies
        try:
            while self._left > 0:
                self._unship(self._next_reply().region_id)
        except (RayError, TransferError) as exc:
            log.info("a stopped ship stream ended with %s", exc)  # its regions lapse by TTL
        finally:
            self._replies = None
