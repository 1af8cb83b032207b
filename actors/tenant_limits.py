"""Per-tenant limits of a storage node: call rate, open leases, open puts.

Quotas bound a tenant's space; these bound what else one tenant can take from the others on
a node: its calls (a token bucket per tenant, ``tenant_calls_per_s`` refilled, at most
``tenant_call_burst`` at once), the leases it holds (``tenant_leases``: each pins scopes and
lives up to ``lease_ttl_s``) and its open puts (``tenant_puts``: each holds allocated space
and landing slots until committed, aborted or expired). A call over a limit is refused with
:class:`TenantLimitError` before it takes or changes anything; calls that give something
back (``release``, ``abort_put``, ``unship``, ``ship_stop``) are never refused, so a tenant at
its limit can always get under it again. Each node counts its own (per tenant, per node).
"""

from __future__ import annotations

import threading
import time

from flatcake_ray.config import ServiceConfig
from flatcake_ray.errors import TenantLimitError


class TenantLimits:
    def __init__(self, config: ServiceConfig) -> None:
        self.calls_per_s = config.tenant_calls_per_s
        self.burst = float(config.tenant_call_burst)
        self.max_leases = config.tenant_leases
        self.max_puts = config.tenant_puts
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)
        self._lock = threading.Lock()
        self.counters = {"calls_limited": 0, "leases_limited": 0, "puts_limited": 0}

    def call(self, tenant: str) -> None:
        """Take one call of ``tenant``'s rate, or refuse it (no limit: ``calls_per_s`` 0)."""
        if self.calls_per_s <= 0:
            return
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.get(tenant, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.calls_per_s)
            if tokens < 1.0:
                self._buckets[tenant] = (tokens, now)
                self.counters["calls_limited"] += 1
                raise TenantLimitError(
                    f"tenant {tenant} is over its call rate on this node "
                    f"({self.calls_per_s:g} calls/s, bursts of {self.burst:g}): retry later"
                )
            self._buckets[tenant] = (tokens - 1.0, now)

    def lease(self, tenant: str, held: int) -> None:
        """Refuse a new lease of ``tenant``, which holds ``held`` here, at its limit."""
        self._below(tenant, held, self.max_leases, ("leases", "holds", "release"))

    def put(self, tenant: str, open_puts: int) -> None:
        """Refuse a new put of ``tenant``, which has ``open_puts`` open here, at its limit."""
        self._below(tenant, open_puts, self.max_puts, ("puts", "has open", "commit or abort"))

    def _below(self, tenant: str, count: int, limit: int, words: tuple[str, str, str]) -> None:
        what, verb, remedy = words
        if count >= limit:
            self.counters[f"{what}_limited"] += 1
            raise TenantLimitError(
                f"tenant {tenant} {verb} {count} {what} on this node, its limit "
                f"(tenant_{what}={limit}): {remedy} some first"
            )

    def drop_tenant(self, tenant: str) -> None:
        with self._lock:
            self._buckets.pop(tenant, None)
