"""Which shared-memory segments a test's processes created, so the test can prove it left none.

Other engineers' engines and clusters share this machine's /dev/shm, so "new files since the
test began" is not ours to judge or remove. A segment is the test's when a process descended
from the test process (engine processes, the Ray cluster it started and that cluster's
actors) maps it; a sampler thread collects those while the test runs.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

SHM = "/dev/shm/"


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(root: int) -> set[int]:
    children = _children()
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def mapped_segments(pids: set[int]) -> set[str]:
    segments: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith(SHM) and not path.endswith("(deleted)"):
                segments.add(path)
    return segments


class ShmTracker:
    """Samples the segments the test's process tree maps, every ``period`` seconds."""

    def __init__(self, period: float = 0.5) -> None:
        self.period = period
        self.before = set(os.listdir(SHM))
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shm-tracker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def sample(self) -> None:
        self.seen |= mapped_segments(descendants(os.getpid()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def leftovers(self, grace_s: float = 10.0) -> list[str]:
        """Segments the test's processes mapped that still exist ``grace_s`` after teardown
        (processes that were told to exit get that long to unlink theirs)."""
        ours = {p for p in self.seen if os.path.basename(p) not in self.before}
        deadline = time.monotonic() + grace_s
        while True:
            left = sorted(p for p in ours if os.path.exists(p))
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.25)
