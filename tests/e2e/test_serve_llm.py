"""Ray Serve LLM over HTTP with ``examples/serve_llm.py``'s own ``build_app`` (``--cpu``)
serving the tiny model on a local 2-node cluster, with the FlatCake service under it.

Over OpenAI ``/v1/completions`` on 127.0.0.1: a prefix is saved, a prompt extending it is
answered from vLLM's own prefix cache (the reference), the replica's prefix cache is reset,
and the same prompt is answered again: its prefix must now come from FlatCake, reported as
cached tokens, with the reference's tokens and bit-identical logprobs.
"""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import pytest

from tests.e2e.conftest import require_vllm, two_node_cluster

require_vllm()

import requests  # noqa: E402

from tests.e2e.engines import BLOCK, MAX_TOKENS, TOP_LOGPROBS  # noqa: E402
from tests.e2e.tiny_model import words  # noqa: E402

NAMESPACE = "fc-e2e-serve"
APP = "flatcake-e2e"
MODEL_ID = "tiny"
PREFIX_BLOCKS = 12
PREFIX_TOKENS = PREFIX_BLOCKS * BLOCK
PREFIX = words(PREFIX_TOKENS, 301)
PROMPT = PREFIX + words(20, 7000)
HINTS = {"flatcake_turn": 2, "flatcake_prior_reply_tokens": 16}
ENGINE_KWARGS = {
    "dtype": "bfloat16",
    "block_size": BLOCK,
    "max_model_len": 2048,
    "max_num_seqs": 4,
    "enforce_eager": True,
    "gpu_memory_utilization": 0.05,
    "kv_cache_memory_bytes": 32 << 20,
    "seed": 0,
}
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve_llm.py"


def load_example():
    spec = importlib.util.spec_from_file_location("serve_llm_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model):
    from ray import serve

    example = load_example()
    argv = ["--model", tiny_model, "--model-id", MODEL_ID, "--namespace", NAMESPACE, "--cpu"]
    argv += ["--engine-kwargs", json.dumps(ENGINE_KWARGS)]
    with two_node_cluster(tmp_path_factory.mktemp("svc"), NAMESPACE) as cluster:
        port = free_port()
        # One proxy, on the head: every node's proxy would bind the same port on this machine.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        try:
            serve.run(example.build_app(example.parser().parse_args(argv)), name=APP)
            yield {"url": f"http://127.0.0.1:{port}", "cluster": cluster}
        finally:
            serve.delete(APP)
            serve.shutdown()


def complete(url: str, prompt: list[int], hints: dict | None = None) -> dict:
    body = {
        "model": MODEL_ID,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": TOP_LOGPROBS,
        "ignore_eos": True,
    }
    if hints:
        body["kv_transfer_params"] = hints
    reply = requests.post(f"{url}/v1/completions", json=body, timeout=300)
    reply.raise_for_status()
    return reply.json()


def cached_tokens(reply: dict) -> int:
    details = reply["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def leased_pages() -> int:
    from flatcake_ray.client import deploy

    return sum(node["hit_pages"] for node in deploy.status(NAMESPACE)["nodes"])


def reset_prefix_cache() -> None:
    from ray import serve

    deployments = serve.status().applications[APP].deployments
    server = next(name for name in deployments if name.startswith("LLMServer"))
    serve.get_deployment_handle(server, app_name=APP).reset_prefix_cache.remote().result()


@pytest.fixture(scope="module")
def replies(served):
    url = served["url"]
    complete(url, PREFIX, HINTS)
    reference = complete(url, PROMPT, HINTS)
    reset_prefix_cache()
    before = leased_pages()
    restored = complete(url, PROMPT)
    return {"reference": reference, "restored": restored, "leased": leased_pages() - before}


def test_reference_is_a_hit_in_vllms_own_prefix_cache(replies):
    assert cached_tokens(replies["reference"]) == PREFIX_TOKENS


def test_after_a_reset_the_prefix_comes_from_flatcake_and_matches(replies):
    restored, reference = replies["restored"], replies["reference"]
    assert cached_tokens(restored) == PREFIX_TOKENS
    assert replies["leased"] >= PREFIX_BLOCKS  # the service handed the prefix out
    assert restored["choices"][0]["text"] == reference["choices"][0]["text"]
    assert restored["choices"][0]["logprobs"] == reference["choices"][0]["logprobs"]
