"""NIXL agents without NIXL's busy progress thread.

NIXL's Python agent runs its progress thread with no delay between polls, so every agent
keeps a core busy even when idle (measured here: ~1 CPU-second per second per agent; on a
2-core machine two storage nodes then take both cores, and loopback NIXL drops from ~4 GB/s
to ~0.2 GB/s). Roles differ:

- a *reader* needs no progress thread: it progresses its own request while it polls
  (measured 6 GB/s on loopback with the reader's thread off);
- an *owner* (memory others READ) must progress, or a remote READ never completes over UCX's
  TCP and shared-memory transports. :func:`exporter_agent` gives it a gentle pump instead: a
  thread that polls the agent every ``PUMP_INTERVAL_S`` (measured ~4 GB/s, ~6 % of a core idle).

``transports/nixl_dram.py`` offers no switch for the thread yet; :class:`_ReaderAgent`
repeats its agent set-up with the thread off. Once ``NixlAgent`` takes a ``progress_thread``
flag (and a ``pump`` option), this module shrinks to two calls.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..errors import TransportUnavailableError
from ..transports.base import RegistrationCache
from ..transports.nixl_dram import NixlAgent, _nixl_api, _nixl_errors

PUMP_INTERVAL_S = 0.0005


class _ReaderAgent(NixlAgent):
    def __init__(self, name: str, *, max_registrations: int = 8) -> None:
        api = _nixl_api()
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            backends=["UCX"],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )
        try:
            self._agent = api.nixl_agent(name, config)
        except (RuntimeError, *_nixl_errors()) as exc:
            raise TransportUnavailableError(
                f"NIXL agent {name!r} failed to start: {exc!r}"
            ) from exc
        if "UCX" not in self._agent.backends:
            raise TransportUnavailableError("NIXL has no UCX plugin")
        self.name = name
        self._stuck: list[tuple[Any, np.ndarray]] = []
        self.destinations = RegistrationCache(self.register, self.deregister, max_registrations)


class _PumpedAgent(_ReaderAgent):
    def __init__(self, name: str, *, max_registrations: int = 8) -> None:
        super().__init__(name, max_registrations=max_registrations)
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._run_pump, name=f"{name}-pump", daemon=True)
        self._pump.start()

    def _run_pump(self) -> None:
        agent = self._agent
        while not self._stop.wait(PUMP_INTERVAL_S):
            # Fetching notifications progresses the agent's UCX workers: that is what lets
            # a peer's READ of our memory complete.
            agent.get_new_notifs()

    def close(self) -> None:
        self._stop.set()
        self._pump.join()
        super().close()


def reader_agent(name: str) -> NixlAgent:
    """An agent for reading others' memory: no progress thread, no idle CPU."""
    return _ReaderAgent(name)


def exporter_agent(name: str) -> NixlAgent:
    """An agent whose registered memory others READ: progressed by a gentle pump."""
    return _PumpedAgent(name)
