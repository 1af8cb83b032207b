"""The one interface every data path implements.

A *transport* copies byte ranges of one source (a node's DRAM arena, an SSD file, a remote
arena) into a caller-owned host buffer. Which transport serves a page is decided purely from
its GVA (see :mod:`flatcake_ray.transports.routing`); the restore pipeline groups a request's
pages by transport, builds one :class:`ReadBatch` per source and calls :meth:`Transport.read`.

Who calls what:

- The restore pipeline's sources (reader side): ``Transport.probe()`` once per process, to
  learn which paths this machine can use (the names it returns ``None`` for form the
  ``available`` set given to ``route``); construct a transport per source (per remote node
  for the remote paths, through :func:`flatcake_ray.transports.registry.transport_class`);
  ``read(batch, dst)`` any number of times, one at a time per instance (``LocalSsdTransport``
  and ``LocalDramTransport`` also from several threads at once); ``close()`` (or leave a
  ``with`` block) when the source goes away.
- The storage node (owner side) never reads through a remote transport: it exports its arena
  (e.g. ``NixlArenaExporter``) and hands the exported description to readers through a Ray
  call. That is one remote call per node touched, never one per block.
- Writers (puts) are the other direction and not transports: the Ray client's put writes a
  layer into memory the owner handed out, mapped on the owner's node or with
  ``transports/nixl_write.py``'s ``NixlDramWriter`` (one one-sided WRITE per layer) from
  another; the owner exports its arena and landing area for that (``actors/node_exports.py``).

Abilities a transport declares (defaults in :class:`Transport`; callers read these, they
never probe with ``getattr``):

- ``destination``: ``"host"`` (``dst`` is a host numpy array) or ``"device"`` (``dst`` is a
  1-D uint8 CUDA tensor: GPUDirect Storage).
- ``broken``: True once a failure left the connection unusable; the caller closes the
  transport and builds a new one (reconnect) instead of reusing it.
- ``actor_calls``: control calls this transport made to the owner so far (shipped SSD reads,
  the object-store fallback); 0 for one-sided paths.
- ``mapped_view()``: a host view of the whole source when this process can address it in
  place (the local arena); the restore pipeline then reads pages there, with no copy.
- ``reads_ahead``: True when the path gains from knowing a restore's reads before it is
  asked for them (a shipped remote SSD read: the owner reads the next window from its SSD
  while this one crosses the wire). Only then may a caller use ``open_stream(batches, lock)``:
  it returns a :class:`ReadStream` that starts on every batch at once; the caller then reads
  them with ``stream.read_next(batch, dst)``, in the order given, from one thread at a time,
  and closes the stream (also when it stops early). ``lock`` is the one the caller holds
  around this transport's ``read``: the stream takes it around its own transfers.

Rules every implementation keeps:

- ``read`` validates the whole batch *before* posting anything: a range outside the source
  or the destination raises :class:`ReadRangeError` and no byte moves.
- ``read`` returns only when every byte landed, or raises :class:`TransferError` (or a
  subclass: :class:`TransferTimeoutError`, :class:`PeerDisconnectedError`); it never hangs
  past its timeout. After an error the destination ranges hold undefined bytes.
- ``dst`` is a 1-D, C-contiguous, writeable ``uint8`` numpy array the caller owns (a torch CPU
  tensor passes as ``tensor.numpy()``). A transport may keep a registration of it between
  reads; it then keeps a reference to it so the memory cannot be freed while registered.
"""

from __future__ import annotations

import abc
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import numpy as np
from numpy.typing import ArrayLike

from flatcake_ray.errors import ReadRangeError, ShapeError

LOCAL_DRAM = "local-dram"
LOCAL_SSD = "local-ssd"
LOCAL_SSD_GDS = "local-ssd-gds"
REMOTE_DRAM_NIXL = "remote-dram-nixl"
REMOTE_DRAM_RDMA = "remote-dram-rdma"
REMOTE_SSD_NVMEOF = "remote-ssd-nvmeof"
REMOTE_SSD_SHIPPED = "remote-ssd-shipped"
OBJECT_STORE_FALLBACK = "object-store-fallback"
# The paths a client's ``allow`` may name (the local ones are always taken on a node's own
# machine).
ALLOWABLE_PATHS = frozenset(
    {
        REMOTE_DRAM_NIXL,
        REMOTE_DRAM_RDMA,
        REMOTE_SSD_NVMEOF,
        REMOTE_SSD_SHIPPED,
        OBJECT_STORE_FALLBACK,
    }
)

# Source offsets are GVA offsets (48 bits); bounding every field there also keeps
# offset + length far from int64 overflow.
_MAX_FIELD = 1 << 48


def _as_offsets(values: ArrayLike, field: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ReadRangeError(f"{field} must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ReadRangeError(f"{field} must hold integers, got dtype {array.dtype}")
    if array.size and (array.min() < 0 or array.max() >= _MAX_FIELD):
        raise ReadRangeError(f"{field} must lie in 0..2**48-1")
    frozen = np.array(array, dtype=np.int64)  # a private copy: the batch is immutable
    frozen.setflags(write=False)
    return frozen


class ReadBatch:
    """Ranges to copy: ``lengths[i]`` bytes from source ``src_offsets[i]`` to
    ``dst[dst_offsets[i]:]``. Fields are read-only int64 arrays of one length (the batch is
    immutable; no ``==``: it would compare arrays elementwise)."""

    __slots__ = ("dst_offsets", "lengths", "src_offsets")
    src_offsets: np.ndarray
    lengths: np.ndarray
    dst_offsets: np.ndarray

    def __init__(self, src_offsets: ArrayLike, lengths: ArrayLike, dst_offsets: ArrayLike):
        object.__setattr__(self, "src_offsets", _as_offsets(src_offsets, "src_offsets"))
        object.__setattr__(self, "lengths", _as_offsets(lengths, "lengths"))
        object.__setattr__(self, "dst_offsets", _as_offsets(dst_offsets, "dst_offsets"))
        sizes = {self.src_offsets.size, self.lengths.size, self.dst_offsets.size}
        if len(sizes) != 1:
            raise ReadRangeError(
                f"src_offsets, lengths and dst_offsets differ in length: "
                f"{self.src_offsets.size}, {self.lengths.size}, {self.dst_offsets.size}"
            )

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a ReadBatch is immutable")

    @classmethod
    def packed(cls, src_offsets: ArrayLike, lengths: ArrayLike, dst_start: int = 0) -> ReadBatch:
        """Ranges laid back to back in the destination, in the order given."""
        lengths_array = np.asarray(lengths, dtype=np.int64)
        ends = np.cumsum(lengths_array)
        return cls(src_offsets, lengths_array, dst_start + ends - lengths_array)

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def total_bytes(self) -> int:
        return int(self.lengths.sum())

    def nonempty(self) -> ReadBatch:
        """The same batch without zero-length ranges (some transports reject them)."""
        keep = self.lengths > 0
        if keep.all():
            return self
        return ReadBatch(self.src_offsets[keep], self.lengths[keep], self.dst_offsets[keep])

    def check_source(self, source_bytes: int, source: str) -> None:
        """Raise :class:`ReadRangeError` unless every range lies in ``[0, source_bytes)``."""
        if len(self) and int((self.src_offsets + self.lengths).max()) > source_bytes:
            worst = int(np.argmax(self.src_offsets + self.lengths))
            raise ReadRangeError(
                f"range {worst} [{int(self.src_offsets[worst])}, +{int(self.lengths[worst])}) "
                f"ends past the {source_bytes} bytes of {source}"
            )

    def check_destination(self, dst: np.ndarray) -> None:
        """Raise unless ``dst`` is a writeable 1-D C-contiguous uint8 array that holds every
        range, and no two ranges overlap in it (their bytes would race)."""
        check_destination_buffer(dst)
        if not len(self):
            return
        ends = self.dst_offsets + self.lengths
        if int(ends.max()) > dst.size:
            raise ReadRangeError(f"a range ends at {int(ends.max())}, past dst's {dst.size} bytes")
        order = np.argsort(self.dst_offsets, kind="stable")
        if np.any(ends[order][:-1] > self.dst_offsets[order][1:]):
            raise ReadRangeError("two ranges overlap in dst")


def check_destination_buffer(dst: object) -> None:
    if not isinstance(dst, np.ndarray):
        raise ShapeError(f"dst must be a numpy uint8 array, got {type(dst).__name__}")
    if dst.dtype != np.uint8 or dst.ndim != 1:
        raise ShapeError(f"dst must be 1-D uint8, got {dst.ndim}-D {dst.dtype}")
    if not dst.flags.c_contiguous or not dst.flags.writeable:
        raise ShapeError("dst must be C-contiguous and writeable")


@dataclass
class TransferStats:
    """What one :meth:`Transport.read` moved: bytes, transfer commands posted (descriptors,
    work requests or syscalls), wall seconds, and the transport name that moved them."""

    bytes: int
    commands: int
    seconds: float
    path: str

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Transport(abc.ABC):
    """One data path. See the module docstring for who calls what and the abilities."""

    name: str = ""
    destination: ClassVar[str] = "host"
    actor_calls: int = 0

    @property
    def broken(self) -> bool:
        return False

    def mapped_view(self) -> np.ndarray | None:
        return None

    reads_ahead: ClassVar[bool] = False

    def open_stream(self, batches: list[ReadBatch], lock: threading.Lock) -> ReadStream:
        """Start every batch now (only for a transport that ``reads_ahead``)."""
        raise NotImplementedError(f"{self.name} does not read ahead")

    @classmethod
    @abc.abstractmethod
    def probe(cls) -> str | None:
        """``None`` when this path can run on this machine, else why not ("no RDMA device")."""

    @abc.abstractmethod
    def read(self, reads: ReadBatch, dst: np.ndarray) -> TransferStats:
        """Copy every range of ``reads`` into ``dst``; return when all bytes landed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource; idempotent. Later reads raise TransportClosedError."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ReadStream(abc.ABC):
    """Batches announced to a transport that reads ahead, taken in the order announced."""

    actor_calls: int = 0  # control calls to the owner so far, as a transport's

    @abc.abstractmethod
    def read_next(self, reads: ReadBatch, dst: np.ndarray) -> TransferStats:
        """The next announced batch (``reads`` must be it) into ``dst``, as ``read`` would."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop reading ahead and free what the owner holds for it; idempotent."""

    def __enter__(self) -> ReadStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


Handle = TypeVar("Handle")


class _Registration(Generic[Handle]):
    __slots__ = ("buffer", "handle", "length", "start", "users")

    def __init__(self, buffer: np.ndarray, handle: Handle) -> None:
        self.buffer = buffer  # pins the memory while it is registered
        self.handle = handle
        self.start = buffer.ctypes.data
        self.length = buffer.nbytes
        self.users = 0

    def covers(self, start: int, length: int) -> bool:
        return self.start <= start and start + length <= self.start + self.length


class RegistrationCache(Generic[Handle]):
    """Registrations of caller buffers for a transport's library (NIXL, verbs MRs).

    Registering is expensive (pins pages, programs the NIC), so a buffer is registered once
    and reused for every later read into it or into any slice of it. Lifetime rule: the cache
    holds a reference to each registered buffer, so its memory stays valid until the entry is
    evicted (least recently used, beyond ``capacity`` and not in use by a read) or the cache
    is cleared at close. Thread-safe; an entry in use is never evicted.
    """

    def __init__(
        self,
        register: Callable[[np.ndarray], Handle],
        release: Callable[[Handle], None],
        capacity: int = 8,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._register = register
        self._release = release
        self._capacity = capacity
        self._entries: OrderedDict[tuple[int, int], _Registration[Handle]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @contextmanager
    def use(self, buffer: np.ndarray) -> Iterator[Handle]:
        """Yield the handle of a registration covering ``buffer``, registering it if none."""
        entry = self._acquire(buffer)
        try:
            yield entry.handle
        finally:
            with self._lock:
                entry.users -= 1

    def _acquire(self, buffer: np.ndarray) -> _Registration[Handle]:
        start, length = buffer.ctypes.data, buffer.nbytes
        with self._lock:
            for key, entry in self._entries.items():
                if entry.covers(start, length):
                    self._entries.move_to_end(key)
                    entry.users += 1
                    return entry
            entry = _Registration(buffer, self._register(buffer))
            entry.users = 1
            self._entries[(start, length)] = entry
            self._evict_idle_beyond_capacity()
            return entry

    def _evict_idle_beyond_capacity(self) -> None:
        idle = [key for key, entry in self._entries.items() if entry.users == 0]
        for key in idle[: max(0, len(self._entries) - self._capacity)]:
            self._release(self._entries.pop(key).handle)

    def clear(self) -> None:
        """Release every registration (at close, when no read is running)."""
        with self._lock:
            while self._entries:
                _, entry = self._entries.popitem(last=False)
                self._release(entry.handle)
