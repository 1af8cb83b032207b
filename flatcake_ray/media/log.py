"""Log a condition once per process (a degraded mode, not an event per call)."""

from __future__ import annotations

import logging

log = logging.getLogger("flatcake_ray.media")
_warned: set[str] = set()


def log_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)
