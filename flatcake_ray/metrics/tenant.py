"""The ``tenant`` tag of a request.

There are no tenants yet: a request's key namespace stands in for its tenant (two engines
sharing a namespace share pages, so they are one tenant as far as the cache can tell). Once
clients are bound to tenants, repoint this one function.
"""

from __future__ import annotations

from flatcake_ray.core.keys import DEFAULT_NAMESPACE


def tenant_of(namespace: str | None) -> str:
    """The tenant tag of a request made in key namespace ``namespace``."""
    return namespace if namespace else DEFAULT_NAMESPACE
