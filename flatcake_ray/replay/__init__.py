"""The trace-replay model: a discrete-event model of a serving engine driving the live
placement, allocation, coalescing and scheduling code with modelled devices and a virtual
clock. Entry points: :func:`run_comparison`, :func:`run_placement_sweep`,
:func:`run_context_sweep`, :func:`write_outputs`; the ``flatcake-ray replay`` command.
"""

from flatcake_ray.replay.profiles import PROFILES, Profile, get_profile
from flatcake_ray.replay.report import markdown_table, write_outputs
from flatcake_ray.replay.sweep import (
    run_comparison,
    run_context_sweep,
    run_one,
    run_placement_sweep,
)
from flatcake_ray.replay.systems import SYSTEMS, SystemSpec

__all__ = [
    "PROFILES",
    "SYSTEMS",
    "Profile",
    "SystemSpec",
    "get_profile",
    "markdown_table",
    "run_comparison",
    "run_context_sweep",
    "run_one",
    "run_placement_sweep",
    "write_outputs",
]
