"""The node's side of handing its memory to a client on its machine (``media/fd_handout.py``):
descriptors of the chunks of the arena or the landing area that the caller's tenant holds
now, and of no other. The node's process is made non-dumpable when it starts (unless the
operator keeps it debuggable), so a process of the same OS user cannot reach the chunks
through ``/proc/<pid>/fd``, ``/proc/<pid>/mem`` or ptrace either (``docs/security.md``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from enum import Enum
from typing import Any

from flatcake_ray.actors.landing import LandingArea
from flatcake_ray.errors import ForeignMemoryError, ShapeError
from flatcake_ray.media.fd_handout import MAX_CHUNKS, check_socket_name, send_chunks
from flatcake_ray.node.store import FlatCakeStore

_PR_GET_DUMPABLE, _PR_SET_DUMPABLE = 3, 4


class NodeMemory(Enum):
    ARENA = "arena"
    LANDING = "landing"


def keep_memory_private() -> None:
    """Make this process non-dumpable: no core dumps, and ``/proc/<pid>`` files and ptrace
    closed to every process without CAP_SYS_PTRACE, its own user's included."""
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def memory_is_private() -> bool:
    """Whether this process is non-dumpable (what :func:`keep_memory_private` made it)."""
    return int(ctypes.CDLL(None).prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0)) == 0


class MemoryHandout:
    def __init__(self, store: FlatCakeStore, landing: LandingArea, timeout_s: float) -> None:
        self.store = store
        self.landing = landing
        self.timeout_s = timeout_s

    def hand(self, tenant: str, socket_name: object, memory: object, offsets: Any) -> int:
        """Send ``tenant``'s chunks of ``memory`` starting at ``offsets`` (None: every one
        it holds) to the process listening on ``socket_name``; returns how many. A chunk
        the tenant does not hold is :class:`ForeignMemoryError`, and nothing is sent."""
        name, kind = check_socket_name(socket_name), _memory(memory)
        held = self._held(tenant, kind)
        wanted = list(held) if offsets is None else _offsets(offsets)
        foreign = [offset for offset in wanted if offset not in held]
        if foreign:
            raise ForeignMemoryError(
                f"{len(foreign)} of the {kind.value} chunks asked for are not this tenant's"
            )
        send_chunks(name, [(offset, *held[offset]) for offset in wanted], self.timeout_s)
        return len(wanted)

    def _held(self, tenant: str, memory: NodeMemory) -> dict[int, tuple[int, int]]:
        """arena offset -> (bytes, descriptor) of each chunk ``tenant`` holds now."""
        if memory is NodeMemory.ARENA:
            arena, chunks = self.store.arena, self.store.arena_chunks(tenant)
        else:
            arena, chunks = self.landing.memory, self.landing.chunks_of(tenant)
        return {c.offset: (c.nbytes, arena.chunk_fd(c.offset)) for c in chunks}


def _memory(memory: object) -> NodeMemory:
    try:
        return NodeMemory(memory)
    except ValueError:
        raise ShapeError(f"memory is 'arena' or 'landing', got {memory!r}") from None


def _offsets(offsets: object) -> list[int]:
    if not isinstance(offsets, Sequence) or isinstance(offsets, (str, bytes)):
        raise ShapeError("offsets must be a list of chunk offsets")
    if len(offsets) > MAX_CHUNKS or not all(
        isinstance(o, int) and not isinstance(o, bool) for o in offsets
    ):
        raise ShapeError(f"offsets must be at most {MAX_CHUNKS} ints")
    return list(offsets)
