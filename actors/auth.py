"""Who may call the service: the service's own secret, and the tenants' table.

- The **service secret** proves a caller is the service itself or its operator: storage nodes
  registering and reporting to the coordinator, ``flatcake-ray start/status/tenant/drain``.
  It lives in a 0600 file on the machine that runs ``start`` (``ServiceConfig.secret_file``)
  and reaches the actors as a constructor argument.
- The **tenant table** lives in Ray's GCS key-value store, written by the coordinator and
  read by every storage node. Any Ray job can write that store, so the table is signed with
  an HMAC keyed by the service secret: a forged or altered table is refused, never used. It
  holds each tenant's name, geometry, quotas and the SHA-256 of its secret, never a secret.
- A :class:`Gate` is one actor's check of a call: which tenant a presented secret belongs to
  (the default tenant for no secret, when the service leaves it open: by default only while
  no named tenant exists), or :class:`AccessDeniedError`, counted.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import msgpack

from flatcake_ray.config import ServiceConfig
from flatcake_ray.core.tenants import DEFAULT_TENANT, Tenant, new_secret, secret_hash
from flatcake_ray.errors import AccessDeniedError, ServiceError, TenantError

KV_NAMESPACE = "flatcake-ray"
TABLE_FORMAT = 1
log = logging.getLogger(__name__)
REFRESH_FLOOR_S = 0.5  # an unknown secret re-reads the table at most this often


# ---- the service secret ----------------------------------------------------------------------
def load_or_create_secret(path: str) -> str:
    """The service secret kept in ``path``, made (mode 0600, parents 0700) on first use."""
    file = Path(path).expanduser()
    if file.exists():
        return _read_secret(file)
    file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    secret = new_secret()
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another start made it first: use theirs
        return _read_secret(file)
    with os.fdopen(fd, "w") as out:
        out.write(secret + "\n")
    return secret


def read_secret(path: str) -> str:
    """The service secret in ``path`` (an operator command: it must exist)."""
    file = Path(path).expanduser()
    if not file.exists():
        raise AccessDeniedError(
            f"no service secret at {file}: run this where `flatcake-ray start` ran, or point "
            "--secret-file (FLATCAKE_SECRET_FILE) at its secret"
        )
    return _read_secret(file)


def _read_secret(file: Path) -> str:
    if file.stat().st_mode & 0o077:
        raise AccessDeniedError(f"{file} is readable by others: chmod 600 it")
    text = file.read_text().strip()
    secret_hash(text)  # the shape check: a typed error for a damaged file
    return text


def same_secret(given: object, secret: str) -> bool:
    return isinstance(given, str) and secrets.compare_digest(given.encode(), secret.encode())


# ---- the signed tenant table -----------------------------------------------------------------
def _key(namespace: str) -> bytes:
    return f"{namespace}/tenants".encode()


def _tag(service_secret: str, body: bytes) -> bytes:
    return hmac.new(service_secret.encode(), body, hashlib.sha256).digest()


def encode_table(tenants: dict[str, Tenant], service_secret: str) -> bytes:
    body = msgpack.packb(
        {"format": TABLE_FORMAT, "tenants": [t.to_record() for t in tenants.values()]}
    )
    return _tag(service_secret, body) + body


def decode_table(raw: bytes | None, service_secret: str) -> dict[str, Tenant]:
    """The tenants of a stored table; a table not signed with this service's secret, or not
    made by this module, is :class:`AccessDeniedError` / :class:`TenantError`."""
    if raw is None:
        return {}
    tag, body = raw[:32], raw[32:]
    if len(raw) < 32 or not hmac.compare_digest(tag, _tag(service_secret, body)):
        raise AccessDeniedError("the tenant table in the GCS is not signed by this service")
    try:
        table = msgpack.unpackb(body)
    except (ValueError, msgpack.ExtraData) as exc:
        raise TenantError(f"the tenant table is not msgpack: {exc}") from None
    if not isinstance(table, dict) or table.get("format") != TABLE_FORMAT:
        raise TenantError("the tenant table has an unknown format")
    records = table.get("tenants", [])
    if not isinstance(records, list):
        raise TenantError(f"the tenant table's tenants are a list, not {type(records).__name__}")
    tenants = [Tenant.from_record(record) for record in records]
    return {t.name: t for t in tenants}


def _kv() -> Any:
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        raise ServiceError("Ray is not initialized: the tenant table lives in its GCS")
    return internal_kv


def read_table(namespace: str, service_secret: str) -> dict[str, Tenant] | None:
    """The stored table's tenants; None when there is no table (none written yet, or the
    GCS lost it)."""
    raw = _kv()._internal_kv_get(_key(namespace), namespace=KV_NAMESPACE)
    return None if raw is None else decode_table(raw, service_secret)


def write_table(namespace: str, tenants: dict[str, Tenant], service_secret: str) -> None:
    raw = encode_table(tenants, service_secret)
    _kv()._internal_kv_put(_key(namespace), raw, overwrite=True, namespace=KV_NAMESPACE)


# ---- a call's check --------------------------------------------------------------------------
class Gate:
    """An actor's check of who calls. ``default`` is the default tenant when the service
    leaves it open (calls without a secret), None when every call needs a secret; it closes
    while the table names a tenant, unless ``default_beside_tenants``."""

    def __init__(
        self,
        namespace: str,
        service_secret: str,
        default: Tenant | None,
        *,
        in_gcs: bool = True,
        default_beside_tenants: bool = False,
    ) -> None:
        self.namespace = namespace
        self._service_secret = service_secret
        self.default = default
        self.default_beside_tenants = default_beside_tenants
        self._in_gcs = in_gcs
        self._by_hash: dict[str, Tenant] = {}
        self.tenants: dict[str, Tenant] = {}
        self._read_at = float("-inf")
        self._lock = threading.Lock()
        self.counters = {"denied_calls": 0, "table_reads": 0, "tables_refused": 0}

    def service(self, given: object) -> None:
        """Pass a caller holding the service secret; anyone else is refused and counted."""
        if not self.is_service(given):
            self._deny("this call needs the service secret")

    def is_service(self, given: object) -> bool:
        return same_secret(given, self._service_secret)

    def tenant(self, given: object) -> Tenant:
        """The tenant whose secret ``given`` is (None or "": the default tenant, if open)."""
        if given is None or (isinstance(given, str) and not given):
            return self._default()
        try:
            digest = secret_hash(given)
        except TenantError:
            self._deny("a tenant secret is a string of 16 to 256 characters")
        known = self._by_hash.get(digest)
        if known is None and self.refresh(force=False):
            known = self._by_hash.get(digest)
        if known is None:
            self._deny("no tenant has this secret")
        return known

    def _default(self) -> Tenant:
        if self.default is None:
            self._deny("this service has no open default tenant: present a tenant secret")
        if not self.tenants:
            self.refresh(force=False)  # a tenant added since the last read closes it
        if self.tenants and not self.default_beside_tenants:
            self._deny(
                "this service has named tenants, so its open default tenant is closed: "
                "present a tenant secret"
            )
        return self.default

    def refresh(self, *, force: bool = True) -> bool:
        """Re-read the table (at most every ``REFRESH_FLOOR_S`` unless forced); True if read."""
        if not self._in_gcs:
            return False
        now = time.monotonic()
        with self._lock:
            if not force and now - self._read_at < REFRESH_FLOOR_S:
                return False
            self._read_at = now
            self.counters["table_reads"] += 1
            try:
                tenants = read_table(self.namespace, self._service_secret)
            except TenantError as exc:
                # Not signed by this service (any Ray job can write the GCS) or damaged: keep
                # the last good table. Adopting nothing would read as "every tenant removed".
                self.counters["tables_refused"] += 1
                log.warning("tenant table refused, the last good one stays: %s", exc)
                return True
            if tenants is not None:  # an absent table removes nobody either
                self.adopt(tenants)
        return True

    def adopt(self, tenants: dict[str, Tenant]) -> None:
        self.tenants = dict(tenants)
        self._by_hash = {t.secret_sha256: t for t in tenants.values()}

    def _deny(self, why: str) -> NoReturn:
        self.counters["denied_calls"] += 1
        raise AccessDeniedError(why)


def service_gate(config: ServiceConfig, service_secret: str, *, in_gcs: bool = True) -> Gate:
    """The gate of a service actor (coordinator or storage node) as ``config`` sets it."""
    default = default_tenant(config.layers, config.page_bytes) if config.open_default else None
    return Gate(
        config.namespace,
        service_secret,
        default,
        in_gcs=in_gcs,
        default_beside_tenants=config.default_beside_tenants,
    )


def default_tenant(layers: int, page_bytes: int) -> Tenant:
    """The open default tenant: the service's own geometry, no quota, no secret."""
    return Tenant(DEFAULT_TENANT, "-", layers, page_bytes)
