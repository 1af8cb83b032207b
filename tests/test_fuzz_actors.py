"""Every StorageNode and CapacityCoordinator method, called through its Ray handle as any Ray
job can, with malformed payloads (wrong types, huge lists, garbage bytes and msgpack, wrong or
missing secrets): only typed errors from ``flatcake_ray.errors`` come back, the actors stay up
(a later valid call works), and nothing stored changes (known pages read back identical).

Also here: the signed tenant table's decoder fed garbage, the client checking the answer of
its lease releases, and puts only into memory the node hands out (no path from a caller).

One closed service (no open default tenant) for the module; hypothesis examples are bounded
(30 each; ``FLATCAKE_FUZZ_EXAMPLES`` for a longer hunt).
"""

from __future__ import annotations

import os
import uuid

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatcake_ray.core.catalog import PutHints
from flatcake_ray.core.keys import DIGEST_DTYPE
from flatcake_ray.errors import AccessDeniedError, FlatCakeError
from tests.conftest import LAYERS, PAGE_BYTES, SMALL_SERVICE

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

NAMESPACE = "fc-fuzz"
DRAM = PutHints(turn=2, prior_reply_tokens=1)
SSD = PutHints(turn=1)
FUZZ = settings(
    max_examples=int(os.environ.get("FLATCAKE_FUZZ_EXAMPLES", "30")),  # more for a long hunt
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
CALL_TIMEOUT_S = 60

# ---- what an attacker sends ------------------------------------------------------------------
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True),
    st.text(max_size=24),
    st.binary(max_size=48),
)
_packable = st.one_of(  # what msgpack can hold: ints of at most 64 bits
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.floats(allow_nan=True),
    st.text(max_size=24),
    st.binary(max_size=48),
)
_msgpack_blobs = st.recursive(_packable, lambda inner: st.lists(inner, max_size=4)).map(
    lambda value: msgpack.packb(value, use_bin_type=True)
)
GARBAGE = st.one_of(
    _scalars,
    _msgpack_blobs,
    st.lists(_scalars, max_size=6),
    st.dictionaries(st.text(max_size=6), _scalars, max_size=3),
    st.builds(lambda n: np.arange(n, dtype=np.float32), st.integers(0, 8)),
)
# Not this service's secrets: missing, malformed, or well-formed and unknown.
BAD_SECRETS = st.one_of(
    st.none(),
    st.just(""),
    GARBAGE,
    st.text(alphabet="0123456789abcdef", min_size=16, max_size=64),
)
_digest_garbage = st.builds(  # packed digests of any length, and of another dtype
    lambda n, dtype: np.zeros(n, dtype=dtype),
    st.integers(0, 8),
    st.sampled_from([np.uint8, np.uint64, np.float32, DIGEST_DTYPE]),
)
ARG = st.one_of(GARBAGE, _digest_garbage, st.builds(PutHints, turn=st.integers(-3, 3)))

# Methods and how many arguments follow the secret (Ray checks arity at .remote() already).
NODE_TENANT_CALLS = {
    "describe": 0,
    "service_config": 0,
    "stats": 0,
    "accept_rdma": 1,
    "lookup": 2,
    "exists": 2,
    "probe": 2,
    "gvas": 2,
    "release": 2,
    "record_home": 2,
    "home_of": 1,
    "find": 3,
    "begin_put": 5,
    "land": 4,
    "commit_put": 3,
    "abort_put": 1,
    "ship": 2,
    "unship": 1,
    "ship_stream": 4,
    "ship_stop": 1,
    "read_ranges": 3,
    "hand_chunks": 3,
}
NODE_SERVICE_CALLS = {
    "coordinator_view": 0,
    "refresh_tenants": 0,
    "arm_failpoints": 1,
    "shutdown": 0,
}
COORDINATOR_CALLS = {
    "register": 4,
    "report": 3,
    "forget": 1,
    "drain": 1,
    "undrain": 1,
    "place_scope": 2,
    "nodes_table": 0,
    "info": 0,
    "service_config": 0,
    "add_tenant": 5,
    "set_tenant_quota": 3,
    "remove_tenant": 1,
    "list_tenants": 0,
}


def kv(pages: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (LAYERS, pages, PAGE_BYTES), dtype=np.uint8)


class Service(dict):
    """The module's service; short in hypothesis's reports of a failing example."""

    def __repr__(self) -> str:
        return "<the fuzzed service>"


@pytest.fixture(scope="module")
def service(ray_service):
    from flatcake_ray.actors.protocol import COORDINATOR_NAME
    from flatcake_ray.client import deploy, tenants
    from flatcake_ray.client.client import FlatCakeClient
    from flatcake_ray.config import ClientConfig

    ray_service(
        NAMESPACE,
        env={"FLATCAKE_FAILPOINTS_REMOTE": "1"},  # the node inherits it: tests arm faults
        **SMALL_SERVICE,
        lease_ttl_s=20.0,
        report_interval_s=0.5,
        ramp_seconds=0.0,
        open_default=False,  # a missing secret is refused, not the default tenant
        # Readers check no DRAM block, so a restore waits for the owner's word on its lease
        # (test_the_client_drops_pages_whose_release_is_not_confirmed).
        verify_dram=False,
    )
    alpha = tenants.add_tenant(NAMESPACE, "alpha", layers=LAYERS, page_bytes=PAGE_BYTES)
    client = FlatCakeClient(NAMESPACE, config=ClientConfig(tenant_secret=alpha))
    known = {"dram": (keys("known-dram", 4), kv(4, 1)), "ssd": (keys("known-ssd", 4), kv(4, 2))}
    client.put(*known["dram"], hints=DRAM)
    client.put(*known["ssd"], hints=SSD)
    node = ray.get_actor(client.nodes.links[1].description.actor_name, NAMESPACE)
    coordinator = ray.get_actor(COORDINATOR_NAME, NAMESPACE)
    yield Service(
        {
            "alpha": alpha,
            "client": client,
            "known": known,
            "node": node,
            "coordinator": coordinator,
            "service_secret": deploy.operator_secret(NAMESPACE),
        }
    )
    client.close()


def keys(prefix: str, pages: int) -> list[str]:
    return [f"{prefix}/{i}" for i in range(pages)]


def outcome(handle, method: str, *args) -> BaseException | None:
    """Call ``method`` on the actor; the error it raised (None if it answered)."""
    try:
        ref = getattr(handle, method).remote(*args)
    except TypeError:
        return None  # refused by Ray's signature check in this process: never sent
    try:
        if isinstance(ref, ray.ObjectRefGenerator):  # a streaming call: its first answer
            ready, _ = ray.wait([ref], timeout=CALL_TIMEOUT_S)
            assert ready, f"{method} streamed nothing in {CALL_TIMEOUT_S}s"
            ref = next(ref)
        ray.get(ref, timeout=CALL_TIMEOUT_S)
    except StopIteration:
        return None  # an empty stream
    except Exception as exc:
        return exc
    return None


def assert_typed(error: BaseException | None, method: str) -> None:
    from ray.exceptions import GetTimeoutError, RayActorError

    assert not isinstance(error, RayActorError | GetTimeoutError), f"{method}: {error!r}"
    if error is not None:
        assert isinstance(error, FlatCakeError), f"{method} raised untyped {error!r}"


def assert_nothing_changed(service) -> None:
    """The actors answer and the known pages read back identical (DRAM and SSD)."""
    assert ray.get(service["node"].ping.remote(), timeout=CALL_TIMEOUT_S) >= 1
    assert ray.get(service["coordinator"].ping.remote(), timeout=CALL_TIMEOUT_S)
    client = service["client"]
    for names, data in service["known"].values():
        out = np.zeros_like(data)
        assert client.get(names, out) == len(names)
        assert np.array_equal(out, data)
    fresh = keys(f"after-{uuid.uuid4().hex[:8]}", 2)  # puts still place and land
    assert client.put(fresh, kv(2, 3), hints=DRAM).pages_written == 2


# ---- wrong or missing secrets: refused, every method --------------------------------------------
@FUZZ
@given(data=st.data(), secret=BAD_SECRETS)
def test_every_node_method_refuses_a_wrong_or_missing_secret(service, data, secret):
    calls = {**NODE_TENANT_CALLS, **NODE_SERVICE_CALLS}
    method = data.draw(st.sampled_from(sorted(calls)))
    args = data.draw(st.lists(ARG, min_size=calls[method], max_size=calls[method]))
    error = outcome(service["node"], method, secret, *args)
    assert isinstance(error, AccessDeniedError), f"{method}({secret!r}, ...): {error!r}"


@FUZZ
@given(data=st.data(), secret=BAD_SECRETS)
def test_every_coordinator_method_refuses_a_wrong_or_missing_secret(service, data, secret):
    method = data.draw(st.sampled_from(sorted(COORDINATOR_CALLS)))
    args = data.draw(
        st.lists(ARG, min_size=COORDINATOR_CALLS[method], max_size=COORDINATOR_CALLS[method])
    )
    error = outcome(service["coordinator"], method, secret, *args)
    assert isinstance(error, AccessDeniedError), f"{method}({secret!r}, ...): {error!r}"


def test_refused_callers_changed_nothing(service):
    assert_nothing_changed(service)


# ---- the right secret, malformed payloads: typed errors only -------------------------------------
@FUZZ
@given(data=st.data())
def test_node_methods_with_malformed_payloads_raise_typed_errors(service, data):
    method = data.draw(st.sampled_from(sorted(NODE_TENANT_CALLS)))
    arity = NODE_TENANT_CALLS[method]
    args = data.draw(st.lists(ARG, min_size=arity, max_size=arity))
    assert_typed(outcome(service["node"], method, service["alpha"], *args), method)


# Service calls with non-str / non-int payloads only: a well-formed one would really drain a
# node, arm a failpoint or remove a tenant.
_NOT_STR_OR_INT = st.one_of(
    st.none(), st.floats(), st.binary(max_size=8), st.lists(st.integers(), max_size=3)
)


COORDINATOR_MUTATORS = (
    *("register", "report", "forget", "drain", "undrain", "add_tenant", "set_tenant_quota"),
    *("remove_tenant", "place_scope"),
)


@FUZZ
@given(method=st.sampled_from(COORDINATOR_MUTATORS), data=st.data())
def test_coordinator_methods_with_malformed_payloads_raise_typed_errors(service, method, data):
    arity = COORDINATOR_CALLS[method]
    args = data.draw(st.lists(_NOT_STR_OR_INT, min_size=arity, max_size=arity))
    secret = service["alpha"] if method == "place_scope" else service["service_secret"]
    assert_typed(outcome(service["coordinator"], method, secret, *args), method)


@FUZZ
@given(spec=_NOT_STR_OR_INT)
def test_remote_failpoint_arming_with_a_malformed_spec_is_a_typed_error(service, spec):
    error = outcome(service["node"], "arm_failpoints", service["service_secret"], spec)
    assert_typed(error, "arm_failpoints")
    assert error is not None


def test_huge_lists_are_refused_with_typed_errors(service):
    node, alpha = service["node"], service["alpha"]
    huge_keys = list(range((1 << 20) + 1))
    for method in ("lookup", "exists", "begin_put"):
        error = outcome(node, method, alpha, huge_keys, None)
        assert isinstance(error, FlatCakeError), f"{method}: {error!r}"
    many = np.zeros((1 << 20) + 1, dtype=np.int64)
    assert isinstance(outcome(node, "read_ranges", alpha, 0, many, many + 1), FlatCakeError)
    assert isinstance(outcome(node, "ship", alpha, many, many + 1), FlatCakeError)


def test_malformed_payloads_changed_nothing(service):
    assert_nothing_changed(service)


# ---- leases: the client drops what it read when the release is not answered True ------------
def test_the_client_drops_pages_whose_release_is_not_confirmed(service):
    """A read whose bytes were not all checked (DRAM with ``verify_dram`` off) counts only
    once the owner says its lease held; a checked one waits for no word
    (``tests/test_service.py``)."""
    node, client = service["node"], service["client"]
    names, data = service["known"]["dram"]
    ray.get(node.arm_failpoints.remote(service["service_secret"], "node.release=oserror*1"))
    try:
        out = np.zeros_like(data)
        before = client.stats(nodes=False)["client"]["lease_expired"]
        assert client.get(names, out) == 0  # read, but the node did not confirm the lease
        assert client.stats(nodes=False)["client"]["lease_expired"] == before + 1
    finally:
        ray.get(node.arm_failpoints.remote(service["service_secret"], ""))
    out = np.zeros_like(data)
    assert client.get(names, out) == len(names) and np.array_equal(out, data)


# ---- puts: only into memory the node handed out ---------------------------------------------
def test_a_staged_put_from_an_arbitrary_file_is_refused(service):
    """``put_staged(kind="shm", path=...)`` made the node ingest any file it could read. Now
    the node names the memory a put's bytes go to (its arena, its landing slots); no method
    takes a path, and the old call does not exist."""
    import inspect

    from flatcake_ray.actors.protocol import PutMemory
    from flatcake_ray.actors.storage_node import StorageNode

    with pytest.raises(AttributeError):
        service["node"].put_staged.remote(service["alpha"], ["k"], None)
    for name, method in inspect.getmembers(StorageNode, inspect.isfunction):
        if name.startswith("_"):
            continue
        named = [p for p in inspect.signature(method).parameters if "path" in p or "staged" in p]
        assert not named, f"StorageNode.{name} takes {named}"
    ticket = ray.get(service["node"].begin_put.remote(service["alpha"], keys("where", 2)))
    try:
        description = ray.get(service["node"].describe.remote(service["alpha"]))
        assert ticket.target.memory is not PutMemory.NONE  # two new pages: somewhere to go
        if ticket.target.memory is PutMemory.ARENA:  # the node's memory, a chunk of alpha's
            offsets = {chunk.offset for chunk in description.arena_chunks}
            assert ticket.target.chunk_offset in offsets
    finally:
        ray.get(service["node"].abort_put.remote(service["alpha"], ticket.put_id))


# ---- the client's own public calls ---------------------------------------------------------------
def test_the_clients_public_calls_refuse_malformed_input_with_typed_errors(service):
    from flatcake_ray.errors import InvalidKeyError, InvalidSessionError, ShapeError

    client = service["client"]
    data = kv(2, 5)
    with pytest.raises(InvalidKeyError, match="list or tuple"):
        client.put((f"g{i}" for i in range(2)), data)
    with pytest.raises(InvalidKeyError, match="list or tuple"):
        client.exists(iter(["g0"]))
    with pytest.raises(InvalidKeyError, match="list or tuple"):
        client.get(iter(["g0"]), np.zeros_like(data))
    with pytest.raises(ShapeError, match="PutHints"):
        client.put(keys("fast", 2), data, hints="fast")
    with pytest.raises(ShapeError, match="at least one key"):
        client.put([], np.zeros((LAYERS, 0, PAGE_BYTES), dtype=np.uint8))
    with pytest.raises(InvalidSessionError):
        client.put(keys("tuple-session", 2), data, session_id=("a", 1))
    assert client.exists(keys("fast", 2)) == 0
    assert_nothing_changed(service)
