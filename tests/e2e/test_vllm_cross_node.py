"""vLLM with ``store: ray`` across nodes: a local 2-node Ray cluster, the FlatCake service
started by the test on node 1, engine A on node 1 saving a prefix, a fresh engine B on node 2
(its own prefix cache off) restoring it over the remote path. Both engines run vLLM's default
multi-process layout, so the connector runs in vLLM's engine-core and worker processes.

A names its cluster by ``ray_address``; B gives none and finds its own node through the
raylet of the Ray worker it descends from.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import require_vllm, two_node_cluster

require_vllm()

from flatcake_ray.integrations.vllm import kv_transfer_config  # noqa: E402
from flatcake_ray.transports import base  # noqa: E402
from tests.e2e import engines  # noqa: E402
from tests.e2e.engines import BLOCK  # noqa: E402
from tests.e2e.tiny_model import words  # noqa: E402

NAMESPACE = "fc-e2e-xnode"
PREFIX_BLOCKS = 12
PREFIX_TOKENS = PREFIX_BLOCKS * BLOCK
PREFIX = words(PREFIX_TOKENS, 77)
PROMPT = PREFIX + words(20, 9000)
HINTS = {"flatcake_turn": 2, "flatcake_prior_reply_tokens": 16}  # a DRAM placement
REMOTE_PATHS = {
    base.REMOTE_DRAM_NIXL,
    base.REMOTE_DRAM_RDMA,
    base.REMOTE_SSD_SHIPPED,
    base.REMOTE_SSD_NVMEOF,
    base.OBJECT_STORE_FALLBACK,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with two_node_cluster(tmp_path_factory.mktemp("svc"), NAMESPACE) as info:
        yield info


@pytest.fixture(scope="module")
def runs(cluster, tiny_model):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from vllm import LLM

    ray_options = {"store": "ray", "ray_namespace": NAMESPACE}
    llm_a = LLM(
        **engines.engine_args(
            tiny_model,
            enable_prefix_caching=True,
            kv_transfer_config=kv_transfer_config(**ray_options, ray_address=cluster["address"]),
        )
    )
    try:
        engines.generate(llm_a, PREFIX, HINTS)
        reference = engines.generate(llm_a, PROMPT, HINTS)
    finally:
        llm_a.llm_engine.engine_core.shutdown()
    on_worker = NodeAffinitySchedulingStrategy(cluster["worker"], soft=False)
    actor = (
        ray.remote(engines.EngineActor)
        .options(num_cpus=1, scheduling_strategy=on_worker)
        .remote(
            engines.engine_args(
                tiny_model,
                enable_prefix_caching=False,
                kv_transfer_config=kv_transfer_config(**ray_options),
            )
        )
    )
    try:
        got = ray.get(actor.generate.remote(PROMPT), timeout=600)
        counters, paths = ray.get([actor.counters.remote(), actor.paths.remote()], timeout=120)
        yield {"reference": reference, "got": got, "counters": counters, "paths": paths}
    finally:
        ray.get(actor.shutdown.remote(), timeout=120)
        ray.kill(actor)


def test_reference_is_a_hit_in_vllms_own_prefix_cache(runs):
    assert runs["reference"].cached_tokens == PREFIX_TOKENS


def test_engine_on_node_2_computes_what_the_prefix_cache_hit_computes(runs):
    got, counters = runs["got"], runs["counters"]
    assert got.cached_tokens == PREFIX_TOKENS
    assert counters["loaded_pages"] == PREFIX_BLOCKS
    assert counters["failed_pages"] == 0
    engines.assert_same_completion(got, runs["reference"])


def test_pages_travelled_node_2_from_node_1_over_a_remote_path(runs):
    moved = {path: tally["pages"] for path, tally in runs["paths"].items() if tally["pages"]}
    assert moved, "engine B's client read nothing"
    assert set(moved) <= REMOTE_PATHS, f"B read locally: {moved}"
    assert sum(moved.values()) == PREFIX_BLOCKS
