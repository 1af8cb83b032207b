"""Whether anyone else is using a drive: what a background writer (``pool_prewrite.py``) asks
before each step, so it writes in the drive's idle time and stays out of live reads and puts.

Live I/O on a node's pool comes from several processes (the store writes, but clients on the
node read the pool files themselves), so no one process sees it all; the block device does.
:class:`DriveActivity` reads the device's counters (``/sys/dev/block/MAJ:MIN/stat``, the
device or partition the pool file is on) and calls the drive busy when, since the last look,
anything was read (the background writer never reads), more was written than the writer's
own bytes (and a little slack for the file system's journal), or a command is in flight now.
Where the file's device has no such counters (tmpfs, overlay, a network file system),
:meth:`DriveActivity.of` gives None and the writer does not pace.
"""

from __future__ import annotations

import os
from pathlib import Path

SECTOR = 512
# Written beyond the writer's own bytes that still counts as idle: the journal commits the
# file system makes for the extents the writer converts.
JOURNAL_SLACK = 1 << 20
# Fields of a block device's stat file (Documentation/block/stat.rst).
READ_SECTORS, WRITE_SECTORS, IN_FLIGHT = 2, 6, 8


class DriveActivity:
    def __init__(self, stat_path: str) -> None:
        """``stat_path``: a block device's stat file (a test passes its own)."""
        self.stat_path = stat_path
        self._read, self._written, _ = self._sample()

    @classmethod
    def of(cls, fd: int) -> DriveActivity | None:
        """The activity of the drive the file open as ``fd`` is on; None where its device
        keeps no counters."""
        device = os.fstat(fd).st_dev
        path = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat")
        return cls(str(path)) if path.is_file() else None

    def _sample(self) -> tuple[int, int, int]:
        with open(self.stat_path, encoding="ascii") as stat:
            fields = [int(value) for value in stat.read().split()]
        return fields[READ_SECTORS], fields[WRITE_SECTORS], fields[IN_FLIGHT]

    def others_since(self, own_bytes: int) -> bool:
        """Whether others used the drive since the last call, ``own_bytes`` being what the
        caller wrote meanwhile (every step of it finished: none of it is in flight now)."""
        read, written, in_flight = self._sample()
        others_read = (read - self._read) * SECTOR
        others_wrote = (written - self._written) * SECTOR - own_bytes
        self._read, self._written = read, written
        return in_flight > 0 or others_read > 0 or others_wrote > JOURNAL_SLACK
