"""Tenants: who may read and write which pages, with which model geometry and quotas.

A tenant is a name, the hash of its secret, its model geometry (layers, bytes of a page of
one layer) and a quota per medium. A client presents the secret on every call; a storage node
hashes it and finds the tenant, and everything the call touches (keys, sessions, leases,
puts, space) is that tenant's alone. The service never stores a secret, only its SHA-256, so
whoever reads the tenant table (it lives in Ray's GCS) learns no secret.

Names are short and plain (``[a-z0-9_-]``, 1 to 64 characters), so ``tenant/namespace`` is
an unambiguous key namespace. The ``default`` tenant is the one a single-tenant deployment
and an in-process store use.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from flatcake_ray.core.gva import Medium
from flatcake_ray.errors import TenantError

DEFAULT_TENANT = "default"
TENANT_NAME = re.compile(r"^[a-z0-9_-]{1,64}$")
SECRET_BYTES = 32


def check_tenant_name(name: object) -> str:
    if not isinstance(name, str) or not TENANT_NAME.match(name):
        raise TenantError(f"a tenant name is 1 to 64 of [a-z0-9_-], not {name!r}")
    return name


def new_secret() -> str:
    return secrets.token_hex(SECRET_BYTES)


def secret_hash(secret: object) -> str:
    """The SHA-256 (hex) of a secret; a malformed secret is a typed error, never a crash."""
    if not isinstance(secret, str) or not 16 <= len(secret) <= 256:
        raise TenantError("a tenant secret is a string of 16 to 256 characters")
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def seal_key(secret: object) -> bytes:
    """The AES-256 key a tenant's SSD pages are sealed under at rest (``cuda_ext/host_seal``):
    derived from its secret, which the service never stores, so only the tenant's clients, and
    the node while they call it, can know it."""
    secret_hash(secret)  # the same checks as any presented secret
    assert isinstance(secret, str)
    material = secret.encode("utf-8", "surrogatepass")
    return hmac.new(material, b"flatcake-ray ssd pages at rest v1", hashlib.sha256).digest()


@dataclass(frozen=True)
class Tenant:
    name: str
    secret_sha256: str
    layers: int
    page_bytes: int
    quota_dram: int | None = None  # bytes; None: no quota (the medium's size)
    quota_ssd: int | None = None

    def __post_init__(self) -> None:
        check_tenant_name(self.name)
        if not isinstance(self.secret_sha256, str):  # a table lookup key: hashable, a str
            raise TenantError(f"tenant {self.name}: its secret's hash is a str")
        if not (isinstance(self.layers, int) and self.layers > 0):
            raise TenantError(f"tenant {self.name}: layers must be a positive int")
        if not (isinstance(self.page_bytes, int) and self.page_bytes > 0):
            raise TenantError(f"tenant {self.name}: page_bytes must be a positive int")
        for quota in (self.quota_dram, self.quota_ssd):
            if quota is not None and not (isinstance(quota, int) and quota >= 0):
                raise TenantError(f"tenant {self.name}: a quota is a byte count >= 0")

    def quota(self, medium: Medium) -> int | None:
        return self.quota_dram if medium is Medium.DRAM else self.quota_ssd

    def namespace(self, namespace: str) -> str:
        """The key namespace of this tenant's ``namespace`` (no tenant can name another's)."""
        return f"{self.name}/{namespace}"

    def matches(self, secret: object) -> bool:
        return secrets.compare_digest(secret_hash(secret), self.secret_sha256)

    def to_record(self) -> dict[str, object]:
        return {
            "name": self.name,
            "secret_sha256": self.secret_sha256,
            "layers": self.layers,
            "page_bytes": self.page_bytes,
            "quota_dram": self.quota_dram,
            "quota_ssd": self.quota_ssd,
        }

    @classmethod
    def from_record(cls, record: object) -> Tenant:
        if not isinstance(record, dict):
            raise TenantError(f"a tenant record is a map, not {type(record).__name__}")
        try:
            return cls(**record)
        except TypeError as exc:
            raise TenantError(f"a tenant record has other fields: {exc}") from None
