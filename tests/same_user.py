"""What a process of the service's OS user with no privileges can open of another process
through ``/proc`` (issue 23's "by path" wall). Root's capabilities are dropped first, so a
root test machine probes as a plain user would. Linux lets a process without capabilities
open another's memory or descriptors only when that one is dumpable and holds no capability
the prober lacks: so the processes compared here drop theirs too (``TARGET``)."""

from __future__ import annotations

import subprocess
import sys

DROP_CAPABILITIES = """
import ctypes, os, sys
header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # capset v3: every capability set emptied
if os.geteuid() == 0 and ctypes.CDLL(None).capset(header, (ctypes.c_uint32 * 6)()) != 0:
    sys.exit("capset failed")
"""

PROBE = (
    DROP_CAPABILITIES
    + """
pid = int(sys.argv[1])
opened = []
try:
    names = os.listdir(f"/proc/{pid}/fd")
except PermissionError:
    names = []
for name in ["mem", *(f"fd/{n}" for n in names), *(f"map_files/{n}" for n in names)]:
    try:
        os.close(os.open(f"/proc/{pid}/{name}", os.O_RDONLY))
        opened.append(name)
    except OSError:
        pass
print(len(names), " ".join(opened))
"""
)

# A process with no capabilities holding a memfd, made private (non-dumpable) when argv[1]
# says so, until its stdin closes.
TARGET = (
    DROP_CAPABILITIES
    + """
from flatcake_ray.actors.memory_handout import keep_memory_private
fd = os.memfd_create("flatcake-probe-target", 0)
if sys.argv[1] == "private":
    keep_memory_private()
print("ready", flush=True)
sys.stdin.read()
"""
)


def opened_through_proc(pid: int) -> list[str]:
    """What the unprivileged probe opened of process ``pid`` ("mem", "fd/N", ...)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(pid)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    return out[1:]


def opened_of_a_target(private: bool) -> list[str]:
    """What the probe opened of a capability-less process, private or not."""
    target = subprocess.Popen(
        [sys.executable, "-c", TARGET, "private" if private else "dumpable"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        return opened_through_proc(target.pid)
    finally:
        target.communicate(timeout=60)
