"""The one contract the restore pipeline reads through: a :class:`Source` of leased pages.

Two implementations: the node's own media (``flatcake_ray.node.source.NodeSource``: the
arena read in place, the pool read with O_DIRECT) and the Ray client's GVA-routed transports
for a lease held on some storage node (``flatcake_ray.client.source.TransportSource``).

Who calls what, in which order (the pipeline is the only caller):

1. ``lease(keys, namespace)`` once per restore, in the submitting thread: locate the
   consecutive hits of ``keys`` and pin them (their scopes cannot be reclaimed) until
   ``release``. Returns a :class:`Leased` (hits, parts, the source's own token). Or, for a
   restore handed a grant (a lease another process took for these keys, ``KVStore.probe``),
   ``granted(grant, keys, namespace)`` instead: the grant's lease, or one taken anew where
   the grant cannot be read under any more; a source that hands out no grants refuses one
   (:class:`~flatcake_ray.errors.LeaseError`).
2. ``access(leased, medium)`` once per medium the parts touch: how that medium is reached
   (mapped in place, or filled into staging slots; verify; alignment; coalescing gap).
3. ``view(leased, medium)`` for a mapped medium: the host bytes its offsets index, and the
   name of that path (for the outcome's per-path tallies).
4. ``announce(leased, fills)`` once, from the window's reader thread before its first fill:
   every ``(medium, reads)`` the restore will fill, in the order it will. A source whose
   path reads ahead (a transport that ``reads_ahead``: the owner of shipped remote SSD
   pages reads the next window while this one crosses) starts them now; any other source
   ignores it. A failure here is the source's to absorb (fills then read one by one).
5. ``fill(leased, medium, reads, slot)`` for a filled medium, from a window's reader thread,
   one chunk at a time, any number of times: read each :class:`SlotRead` into the slot's host
   bytes, or, for a path that reads straight into GPU memory (GDS), into its device twin
   (then say so: ``FillStats.on_device``). SSD bytes of a sealed part (``LeasePart.sealed``)
   are filled as they lie on the drive; the pipeline unseals them in the slot with the
   source's ``seal_key`` (a source with a key reads sealed parts through host slots, never
   GDS).
   Raises :class:`~flatcake_ray.errors.TransferError` when the bytes cannot be had (the
   pages of that chunk become misses); any other exception fails the restore.
6. ``release(leased, outcome)`` exactly once, when the restore ends (also after a failure):
   unpin, account, hand over checksum failures; returns the verified prefix length the
   restore may report (a source may withdraw pages, e.g. when its lease lapsed mid-read).

``fills_dram`` is an ability the source declares: True when DRAM pages may come through
staging slots (a remote arena), so the pipeline gives its DRAM lane slots of its own.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flatcake_ray.core.chunks import SlotRead
from flatcake_ray.core.gva import Medium
from flatcake_ray.core.keys import KeyLike, PageKey
from flatcake_ray.core.parts import LeasePart
from flatcake_ray.core.plan import MediumAccess
from flatcake_ray.errors import LeaseError


@dataclass
class Leased:
    """A located, pinned prefix: the consecutive hits of a restore's keys."""

    hits: int
    parts: tuple[LeasePart, ...]
    token: Any  # the source's own lease: opaque to the pipeline


@dataclass(frozen=True)
class MappedView:
    """A medium this process addresses in place: its bytes, and the path's name."""

    view: np.ndarray
    path: str


@dataclass
class PathTally:
    """What one data path moved for one restore (or in total, in a client's stats)."""

    reads: int = 0
    pages: int = 0
    bytes: int = 0
    io_commands: int = 0
    seconds: float = 0.0

    def merge(self, other: PathTally) -> None:
        self.reads += other.reads
        self.pages += other.pages
        self.bytes += other.bytes
        self.io_commands += other.io_commands
        self.seconds += other.seconds


@dataclass
class FillStats:
    """What one :meth:`Source.fill` moved, and by which path."""

    path: str
    bytes: int
    commands: int
    seconds: float
    actor_calls: int = 0  # control calls the path made to the owner (shipped reads)
    on_device: bool = False  # the bytes landed in the slot's device twin, not its host bytes


@dataclass
class Slot:
    """One staging slot of a window: aligned host bytes and, for a GPU destination, a device
    twin of the same size on the window's CUDA stream."""

    host: np.ndarray | None
    device: Any  # torch.Tensor on the GPU, or None
    stream: Any  # the window's torch.cuda.Stream, or None
    nbytes: int  # memory this slot holds, host and device


@dataclass
class ReadOutcome:
    """How a restore ended, handed to :meth:`Source.release`."""

    pages: int  # the verified prefix (consecutive pages from the first)
    bad_scopes: set[int] = field(default_factory=set)  # a checksum failed: re-check there
    lost_scopes: set[int] = field(default_factory=set)  # bytes unreachable: a plain miss
    failures: list[str] = field(default_factory=list)
    paths: dict[str, PathTally] = field(default_factory=dict)
    bytes_read: dict[Medium, int] = field(default_factory=dict)  # incl. alignment and gaps
    commands: dict[Medium, int] = field(default_factory=dict)
    bytes_wanted: dict[Medium, int] = field(default_factory=dict)  # delivered page bytes
    actor_calls: int = 0
    # Set by the pipeline, for the source's accounting (metrics): what was asked, and when.
    requested: int = 0  # pages the request asked for (hits and misses)
    asked_at: float = 0.0  # pipeline clock: submit() called, before the lease
    queued_s: float = 0.0  # leased -> dispatched to a window or the DRAM lane
    seconds: float = 0.0  # submit() -> ended (set just before release)

    def tally(self, path: str) -> PathTally:
        return self.paths.setdefault(path, PathTally())


class Source(abc.ABC):
    """See the module docstring for who calls what."""

    layers: int
    page_bytes: int
    fills_dram: bool = False

    @property
    def seal_key(self) -> bytes | None:
        """The key its tenant's sealed SSD pages are unsealed with (``core.tenants.seal_key``);
        None: sealed parts stay sealed and fail their checks (misses)."""
        return None

    @abc.abstractmethod
    def lease(self, keys: Sequence[KeyLike | PageKey], namespace: str | None) -> Leased: ...

    def granted(
        self, grant: Any, keys: Sequence[KeyLike | PageKey], namespace: str | None
    ) -> Leased:
        """Step 1 for a restore handed a grant: none is this source's."""
        raise LeaseError(f"this store hands out no lease grants, got {grant!r}")

    @abc.abstractmethod
    def access(self, leased: Leased, medium: Medium) -> MediumAccess: ...

    @abc.abstractmethod
    def view(self, leased: Leased, medium: Medium) -> MappedView: ...

    def announce(self, leased: Leased, fills: Sequence[tuple[Medium, Sequence[SlotRead]]]) -> None:
        """Step 4: nothing to start for a source whose paths do not read ahead."""
        return None

    @abc.abstractmethod
    def fill(
        self, leased: Leased, medium: Medium, reads: Sequence[SlotRead], slot: Slot
    ) -> FillStats: ...

    @abc.abstractmethod
    def release(self, leased: Leased, outcome: ReadOutcome) -> int: ...
