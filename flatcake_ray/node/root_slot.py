"""A storage node's claim on a root of its machine: the ``{slot}`` of the default root.

The default root (``/var/tmp/flatcake/{namespace}/{host}-{slot}``) is the same on every start
of a machine's storage node, so a node that restarts (Ray restarts its actor, or its Ray node
is killed and joins again) finds its ``node_id`` file and its SSD pool again. Several storage
nodes of one namespace on one machine (``ray.cluster_utils.Cluster`` puts every Ray node on
one host; so may an operator) must not share a root: each takes the smallest slot whose lock
file (``<root>/.slot.lock``, ``flock``) no other process holds, and holds it for its life. A
crash releases it (the kernel drops a dead process's ``flock``), so the node that comes back
takes that slot again. A root without ``{slot}`` has one slot: a second claimant gets
:class:`StoreInUseError`, as a second opener of a store does.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

from flatcake_ray.errors import StoreInUseError

SLOT_LOCK_NAME = ".slot.lock"
MAX_SLOTS = 256  # storage nodes of one namespace on one machine


class RootSlot:
    """The slot index a storage node holds and its root; :meth:`close` gives it up."""

    def __init__(self, index: int, root: Path, fd: int) -> None:
        self.index = index
        self.root = root
        self._fd = fd

    @classmethod
    def claim(cls, root_of: Callable[[int], str]) -> RootSlot:
        """The smallest free slot of the roots ``root_of(0)``, ``root_of(1)``, ...; the
        folder is made on the claim (a taken slot's folder exists already)."""
        seen: set[str] = set()
        for index in range(MAX_SLOTS):
            root = Path(root_of(index))
            if str(root) in seen:
                break  # the root does not depend on the slot: there is only one
            seen.add(str(root))
            fd = _try_lock(root)
            if fd is not None:
                return cls(index, root, fd)
        raise StoreInUseError(
            f"every root of this machine ({', '.join(sorted(seen)[:3])}, ...) is held by "
            "another storage node; stop one, or give this node its own root"
        )

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor releases its flock
            self._fd = -1


def _try_lock(root: Path) -> int | None:
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / SLOT_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
