"""NIXL agents for the two roles, without NIXL's busy progress thread.

NIXL's progress thread polls with no delay between polls, so every agent keeps a core busy
even when idle (measured here: ~1 CPU-second per second per agent; on a 2-core machine two
storage nodes then take both cores, and loopback NIXL drops from ~4 GB/s to ~0.2 GB/s):

- a *reader* needs no progress thread: it progresses its own request while it polls
  (measured 6 GB/s on loopback with the reader's thread off);
- an *owner* (memory others READ) must progress, or a remote READ never completes over UCX's
  TCP and shared-memory transports: a gentle pump polls it every ``PUMP_INTERVAL_S`` while
  peers hold its memory (measured ~4 GB/s), and every ``PUMP_IDLE_S`` when none does: 16
  idle storage nodes took 0.81 of a core polling at full rate, 0.18 in all with the slow
  idle poll (``docs/scaling.md``, background work).
"""

from __future__ import annotations

from collections.abc import Callable

from flatcake_ray.transports.nixl_agent import PUMP_INTERVAL_S, NixlAgent

__all__ = ["PUMP_INTERVAL_S", "exporter_agent", "reader_agent"]


def reader_agent(name: str) -> NixlAgent:
    """An agent for reading others' memory: no progress thread, no idle CPU."""
    return NixlAgent(name, progress="none")


def exporter_agent(name: str, busy: Callable[[], bool] | None = None) -> NixlAgent:
    """An agent whose registered memory others READ: progressed by a gentle pump, at full
    rate while ``busy()`` (leases, ship regions or puts out to peers) or just after a wake."""
    return NixlAgent(name, progress="pump", busy=busy)
