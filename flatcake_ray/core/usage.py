"""How much of each medium one tenant uses, against its quota or the medium itself.

``used`` counts the bytes this tenant's segments fill per medium (a scope's run may reserve
more, as room to grow contiguously; that slack is not the tenant's use and is not counted),
and DRAM read replicas are never counted (they are dropped before anything else).
"""

from __future__ import annotations

from flatcake_ray.core.extents import MediumSpace
from flatcake_ray.core.gva import Medium


class MediaUse:
    """A tenant's use of the store's shared ``space``; ``quota`` None on a medium = none."""

    def __init__(
        self, space: dict[Medium, MediumSpace], quota: dict[Medium, int | None] | None = None
    ) -> None:
        self.space = space
        self.quota: dict[Medium, int | None] = quota or dict.fromkeys(Medium)
        self.used = dict.fromkeys(Medium, 0)

    def fraction(self, medium: Medium, extra: int = 0) -> float:
        """How full ``medium`` is for this tenant: of its quota if it has one, else of the
        medium (``extra`` bytes counted as if placed)."""
        quota = self.quota[medium]
        if quota is not None:
            return (self.used[medium] + extra) / quota if quota else 1.0
        space = self.space[medium]
        return space.used_fraction + extra / space.capacity if space.capacity else 1.0

    def within_quota(self, medium: Medium, nbytes: int) -> bool:
        quota = self.quota[medium]
        return quota is None or self.used[medium] + nbytes <= quota
