"""Per-tenant limits (``actors/tenant_limits.py``) and the default tenant's closing
(``actors/auth.py`` ``Gate``), as plain objects; the live service's are in
``tests/test_tenant_limits_ray.py``."""

from __future__ import annotations

import pytest

from flatcake_ray.actors.auth import Gate, default_tenant, service_gate
from flatcake_ray.actors.tenant_limits import TenantLimits
from flatcake_ray.config import ServiceConfig
from flatcake_ray.core.tenants import Tenant, new_secret, secret_hash
from flatcake_ray.errors import AccessDeniedError, ConfigError, TenantLimitError

SERVICE_SECRET = new_secret()


def a_tenant(name: str) -> tuple[Tenant, str]:
    secret = new_secret()
    return Tenant(name, secret_hash(secret), 4, 8192), secret


def gate(**config) -> Gate:
    return service_gate(ServiceConfig(**config), SERVICE_SECRET, in_gcs=False)


def test_the_default_tenant_closes_as_soon_as_a_named_tenant_exists():
    checked = gate()
    assert checked.tenant(None) == default_tenant(32, 64 << 10)  # no tenant yet: open
    alpha, secret = a_tenant("alpha")
    checked.adopt({"alpha": alpha})
    for anonymous in (None, ""):
        with pytest.raises(AccessDeniedError, match="named tenants"):
            checked.tenant(anonymous)
    assert checked.tenant(secret) == alpha
    assert checked.counters["denied_calls"] == 2
    checked.adopt({})  # the last named tenant removed: open again
    assert checked.tenant(None).name == "default"


def test_the_operator_may_keep_it_open_beside_tenants_or_close_it_always():
    beside = gate(default_beside_tenants=True)
    beside.adopt(dict([(lambda t: (t[0].name, t[0]))(a_tenant("alpha"))]))
    assert beside.tenant(None).name == "default"
    closed = gate(open_default=False)
    with pytest.raises(AccessDeniedError, match="no open default tenant"):
        closed.tenant(None)


def limits(**config) -> TenantLimits:
    return TenantLimits(ServiceConfig(**config))


def test_a_tenant_over_its_call_rate_is_refused_and_others_are_not():
    limited = limits(tenant_calls_per_s=0.001, tenant_call_burst=3)
    for _ in range(3):
        limited.call("hog")
    with pytest.raises(TenantLimitError, match="over its call rate"):
        limited.call("hog")
    limited.call("calm")  # each tenant has its own bucket
    assert limited.counters["calls_limited"] == 1
    limited.drop_tenant("hog")  # a tenant removed and added again starts full
    limited.call("hog")


def test_no_call_limit_when_the_rate_is_zero():
    unlimited = limits(tenant_calls_per_s=0, tenant_call_burst=1)
    for _ in range(100):
        unlimited.call("any")


def test_leases_and_puts_are_refused_at_their_limits():
    limited = limits(tenant_leases=2, tenant_puts=1)
    limited.lease("a", 1)
    with pytest.raises(TenantLimitError, match="tenant_leases=2"):
        limited.lease("a", 2)
    limited.put("a", 0)
    with pytest.raises(TenantLimitError, match="tenant_puts=1"):
        limited.put("a", 1)
    assert (limited.counters["leases_limited"], limited.counters["puts_limited"]) == (1, 1)


@pytest.mark.parametrize(
    "field, value",
    [
        ("tenant_calls_per_s", -1.0),
        ("tenant_call_burst", 0),
        ("tenant_leases", 0),
        ("tenant_puts", -2),
    ],
)
def test_limit_fields_are_validated(field, value):
    with pytest.raises(ConfigError) as caught:
        ServiceConfig(**{field: value})
    assert caught.value.fields == (field,)


def test_limit_fields_come_from_every_source():
    environ = {"FLATCAKE_TENANT_LEASES": "7", "FLATCAKE_TENANT_CALLS_PER_S": "12.5"}
    config = ServiceConfig.from_env(environ, tenant_puts=3)
    assert (config.tenant_leases, config.tenant_calls_per_s, config.tenant_puts) == (7, 12.5, 3)
    assert ServiceConfig.from_env({"FLATCAKE_DEFAULT_BESIDE_TENANTS": "yes"}).default_beside_tenants
    with pytest.raises(ConfigError, match="FLATCAKE_TENANT_PUTS"):
        ServiceConfig.from_env({"FLATCAKE_TENANT_PUTS": "many"})


def test_start_takes_the_limit_and_default_flags():
    from flatcake_ray.cli import build_parser
    from flatcake_ray.cli.service import config_from_args

    argv = ["start", "--default-beside-tenants", "--tenant-leases", "9", "--tenant-puts", "2"]
    argv += ["--tenant-calls-per-s", "0.5", "--tenant-call-burst", "4"]
    config = config_from_args(build_parser().parse_args(argv))
    assert config.default_beside_tenants is True
    assert (config.tenant_leases, config.tenant_puts) == (9, 2)
    assert (config.tenant_calls_per_s, config.tenant_call_burst) == (0.5, 4)
