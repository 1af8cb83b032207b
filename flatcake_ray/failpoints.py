"""Failpoints: named places in the code where a test can make a fault happen.

Code marks a point with ``failpoint("manifest.append")`` (keyword arguments give an armed
action some context). Unarmed, a point costs one dict truthiness check. Tests arm points with
:func:`arm` (raise an exception, once, N times or always, optionally after letting the first
hits through; or call a function), and disarm them all with the ``failpoints`` fixture of
``tests/conftest.py`` (a ``yield`` fixture calling :func:`disarm_all`), never by patching
module attributes. Arming and hitting are thread-safe.

Processes a test does not run in (Ray actors) arm points from the environment at import:
``FLATCAKE_FAILPOINTS="manifest.append=oserror*2;store.publish=crash"``; actions are
``oserror`` (EIO), ``enospc``, ``crash`` (``os._exit(137)``, as a kill -9 would) and
``sleep:SECONDS``; ``*N`` fires N times (default: always), ``@K`` lets the first K hits pass.

Points placed today:

- ``manifest.append``: before a record's bytes are written (context: ``record``, the dict).
- ``manifest.fsync``: after a record's bytes are written, before its fsync.
- ``manifest.rewrite``: before the compacted manifest replaces the old one at open.
- ``config.load_file``: before a config file is read (context: ``path``).
- ``config.build``: before a config is built from its merged sources (context: ``cls``).

- ``store.write_layer``: before pages of a layer go to DRAM or to the SSD layer staging
  (context: ``layer``, ``medium``).
- ``store.publish``: between a segment's manifest record and its keys becoming visible
  (context: ``segment``).
- ``source.fill``: before a restore chunk's bytes are read, by the node's own source or the
  Ray client's (context: ``medium``, and ``path`` on the client). An ``OSError`` there is a
  failed read: the chunk's pages become misses.
- ``node.release``: when a storage node handles a lease release (context: ``lease_id``).
- ``pool.allocate``: before an SSD pool file is pre-allocated at open (context: ``path``).
- ``pool.write``: before bytes go to an SSD pool file (context: ``offset``).
- ``pool.prewrite``: before a step of zeros goes over never-written pool space, under the lock
  data writes claim their ranges with (context: ``offset`` in its file).
- ``plan.chunks``: when a restore plans the reads of a layer group (context: ``first``,
  ``end``); ``scheduler.start_prefetches`` and ``scheduler.prefetch_done`` (context:
  ``request_id``): the restore scheduler's bookkeeping.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flatcake_ray.errors import ConfigError

ENV_VAR = "FLATCAKE_FAILPOINTS"

_armed: dict[str, Armed] = {}  # empty means every point is a no-op
_lock = threading.Lock()


@dataclass
class Armed:
    """One armed point: what it does, how often, and how many times it was hit."""

    name: str
    action: Callable[..., Any]
    times: int | None  # None: every hit fires
    skip: int  # hits that pass before the first one fires
    hits: int = 0
    fired: int = 0

    def _take(self) -> bool:
        """Count a hit; True when this hit fires (called under the module lock)."""
        self.hits += 1
        if self.hits <= self.skip:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        self.fired += 1
        return True


def failpoint(name: str, **context: Any) -> None:
    """Run the action armed at ``name``, if any; a no-op otherwise."""
    if not _armed:
        return
    point = _armed.get(name)  # one dict read is atomic; the lock guards only the counts
    if point is None:
        return
    with _lock:
        fire = point._take()
    if fire:
        point.action(**context)


def _raiser(exc: BaseException | type[BaseException]) -> Callable[..., None]:
    def action(**_context: Any) -> None:
        # A class is raised fresh each time; an instance as given (its traceback grows).
        raise exc() if isinstance(exc, type) else exc

    return action


def arm(
    name: str,
    *,
    raises: BaseException | type[BaseException] | None = None,
    call: Callable[..., Any] | None = None,
    times: int | None = 1,
    skip: int = 0,
) -> Armed:
    """Arm ``name``: raise ``raises`` or call ``call(**context)``, ``times`` times (None:
    every hit) after ``skip`` hits have passed. Re-arming a point replaces its action."""
    if (raises is None) == (call is None):
        raise TypeError("arm() needs exactly one of raises= or call=")
    if (times is not None and times < 1) or skip < 0:
        raise ValueError("times must be >= 1 (or None) and skip >= 0")
    action = call if call is not None else _raiser(raises)  # type: ignore[arg-type]
    point = Armed(name, action, times, skip)
    with _lock:
        _armed[name] = point
    return point


def disarm(name: str) -> None:
    with _lock:
        _armed.pop(name, None)


def disarm_all() -> None:
    with _lock:
        _armed.clear()


def armed() -> dict[str, Armed]:
    """A snapshot of the armed points."""
    with _lock:
        return dict(_armed)


# ---- arming from the environment (other processes) -------------------------------------------
def _crash(**_context: Any) -> None:
    os._exit(137)


def _os_error(code: int) -> Callable[..., None]:
    def action(**_context: Any) -> None:
        raise OSError(code, f"failpoint: {os.strerror(code)}")

    return action


def _env_action(text: str) -> Callable[..., Any]:
    if text == "oserror":
        return _os_error(errno.EIO)
    if text == "enospc":
        return _os_error(errno.ENOSPC)
    if text == "crash":
        return _crash
    if text.startswith("sleep:"):
        seconds = float(text.removeprefix("sleep:"))
        return lambda **_context: time.sleep(seconds)
    raise ConfigError(f"{ENV_VAR}: unknown action {text!r} (oserror, enospc, crash, sleep:S)")


def arm_from_spec(spec: str) -> list[Armed]:
    """Arm the points of a ``name=action[*N][@K];...`` spec (see the module docstring)."""
    if not isinstance(spec, str):  # a remote caller may send anything
        raise ConfigError(f"{ENV_VAR}: a spec is a str, not {type(spec).__name__}")
    points = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, sep, rest = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"{ENV_VAR}: {item!r} is not name=action")
        try:
            rest, _, skip = rest.partition("@")
            action, _, times = rest.partition("*")
            point = arm(
                name.strip(),
                call=_env_action(action.strip()),
                times=int(times) if times else None,
                skip=int(skip) if skip else 0,
            )
        except ValueError as exc:
            raise ConfigError(f"{ENV_VAR}: cannot read {item!r}: {exc}") from exc
        points.append(point)
    return points


if os.environ.get(ENV_VAR):
    arm_from_spec(os.environ[ENV_VAR])
