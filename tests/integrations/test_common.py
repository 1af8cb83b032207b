"""The engine-independent parts of the adapters, on a real in-process store (no engine needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flatcake_ray.core.api import Probe
from flatcake_ray.core.catalog import PutHints
from flatcake_ray.errors import ConfigError, StoreClosedError
from flatcake_ray.integrations._common import (
    Geometry,
    close_local_stores,
    make_namespace,
    open_store,
    release_store,
    warm_up,
)

GEOMETRY = Geometry(layers=2, page_bytes=4096)
SHORT_CHAT = PutHints(turn=2, prior_reply_tokens=10)  # placed on DRAM


def pages(count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (GEOMETRY.layers, count, GEOMETRY.page_bytes)
    return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)


def test_one_store_per_root_in_a_process(local_store_options):
    store = open_store(local_store_options, GEOMETRY)
    assert open_store(local_store_options, GEOMETRY) is store
    with pytest.raises(ConfigError, match="holds pages of"):
        open_store(local_store_options, Geometry(3, 4096))


def test_a_second_process_on_the_root_is_refused(local_store_options):
    open_store(local_store_options, GEOMETRY)
    code = (
        "from flatcake_ray.integrations._common import Geometry, open_store\n"
        f"open_store({local_store_options!r}, Geometry(2, 4096))"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode != 0
    assert "store: ray" in child.stderr


def test_probe_tells_the_slowest_medium(local_store_options):
    store = open_store(local_store_options, GEOMETRY)
    store.put([b"a", b"b"], pages(2, 0), namespace="ns", hints=SHORT_CHAT)
    assert store.probe([b"a", b"b", b"c"], namespace="ns") == Probe(2, False)
    agentic = PutHints(context_tokens=1 << 20)  # placed on SSD
    result = store.put([b"c"], pages(1, 1), namespace="ns", parent=b"b", hints=agentic)
    assert result.medium.name == "SSD"
    assert store.probe([b"a", b"b", b"c"], namespace="ns") == Probe(3, True)
    assert store.probe([b"x"], namespace="ns") == Probe(0, False)


def test_an_in_process_store_closes_with_its_last_user(local_store_options):
    first = open_store(local_store_options, GEOMETRY)
    second = open_store(local_store_options, GEOMETRY)
    assert first is second
    release_store(first)
    first.put([b"k"], pages(1, 3), namespace="ns")  # still open: one user left
    release_store(second)
    with pytest.raises(StoreClosedError):
        first.exists([b"k"], namespace="ns")
    assert open_store(local_store_options, GEOMETRY) is not first  # the root is free again


def test_unknown_store_kind_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown store kind"):
        open_store({"store": "nowhere"}, GEOMETRY)
    close_local_stores()


def test_namespace_drops_empty_parts():
    assert make_namespace("vllm", "org/model", "", None, "b16") == "vllm/org/model/b16"


class _WarmUpFails:
    """A store whose warm-up raises ``error`` (what a node gone since connecting does)."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def warm_up(self, *, peers: bool = True) -> None:
        self.calls += 1
        raise self.error


def test_an_adapters_warm_up_that_fails_leaves_the_engine_starting(caplog):
    """A store error in the warm-up an adapter makes as it starts is logged, not raised (the
    first requests pay it, or miss); a bug (any other exception) still raises."""
    from flatcake_ray.errors import ServiceError

    failing = _WarmUpFails(ServiceError("storage node 3 went away"))
    with caplog.at_level("WARNING"):
        warm_up(failing)  # type: ignore[arg-type]
    assert failing.calls == 1
    assert "warm-up failed" in caplog.text and "storage node 3 went away" in caplog.text
    with pytest.raises(ZeroDivisionError):
        warm_up(_WarmUpFails(ZeroDivisionError()))  # type: ignore[arg-type]
