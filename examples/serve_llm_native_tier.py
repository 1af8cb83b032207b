"""Serve a model with Ray Serve LLM, FlatCake-Ray as a tier of vLLM's native KV offloading.

    flatcake-ray start ...                      # the service, once per cluster (layers 1,
                                                # page_bytes = one CPU-tier chunk; see below)
    python examples/serve_llm_native_tier.py --address HOST:PORT \
        --model Qwen/Qwen2.5-0.5B-Instruct --cpu-tier-bytes 8GiB

Each replica keeps vLLM's own offloading: the OffloadingConnector with its CPU tier in the
replica's host memory (``--cpu-tier-bytes``); FlatCake-Ray is the secondary tier below it,
named in ``secondary_tiers`` by class and module path (vLLM imports it in the engine's
scheduler process; no registration step). Chunks the CPU tier holds cascade into the
cluster's flat store; a replica whose CPU tier lacks a chunk promotes it from FlatCake-Ray,
whichever replica on whichever node stored it. The other flags are ``serve_llm.py``'s.

The service's page is one CPU-tier chunk: ``layers`` 1 (the tier's ``layers`` option can
split a chunk into equal layers to match a service) and ``page_bytes`` the chunk's bytes,
``num_layers x 2 x block_size x kv_heads x head_dim x dtype bytes`` per tensor-parallel rank
times the ranks, rounded up to 4 KiB. A service of another geometry is refused with a typed
error naming both.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from serve_llm import main as serve_main  # the same flags and serving, this file's folder
from serve_llm import parser as connector_parser

from flatcake_ray.config import parse_size
from flatcake_ray.integrations.vllm_tier import kv_transfer_config


def engine_kwargs(args: argparse.Namespace, ray_address: str | None) -> dict[str, Any]:
    """vLLM's engine arguments: native offloading, FlatCake-Ray below its CPU tier."""
    tier_options: dict[str, Any] = {"store": "ray", "ray_namespace": args.namespace}
    if ray_address:
        tier_options["ray_address"] = ray_address
    kwargs: dict[str, Any] = {
        "tensor_parallel_size": args.tp,
        "enable_prefix_caching": True,
        "enable_prompt_tokens_details": True,
        "kv_transfer_config": kv_transfer_config(
            parse_size(args.cpu_tier_bytes), layers=args.tier_layers, **tier_options
        ),
    }
    kwargs.update(json.loads(args.engine_kwargs))
    return kwargs


def build_app(args: argparse.Namespace):
    import ray
    from ray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app

    address = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    placement: dict[str, Any] = {"accelerator_type": args.accelerator}
    if args.cpu:
        placement = {"accelerator_config": {"kind": "cpu"}}
    llm_config = LLMConfig(
        model_loading_config={"model_id": args.model_id or args.model, "model_source": args.model},
        engine_kwargs=engine_kwargs(args, address),
        runtime_env={"env_vars": {"PYTHONHASHSEED": args.hash_seed} if args.hash_seed else {}},
        deployment_config={
            "autoscaling_config": {"min_replicas": 1, "max_replicas": args.replicas}
        },
        **placement,
    )
    return build_openai_app(LLMServingArgs(llm_configs=[llm_config]))


def parser() -> argparse.ArgumentParser:
    cli = connector_parser()
    cli.description = __doc__.splitlines()[0]
    cli.add_argument("--cpu-tier-bytes", default="4GiB", help="vLLM's CPU tier per replica")
    cli.add_argument("--tier-layers", type=int, default=1, help="the service's layers")
    return cli


if __name__ == "__main__":
    serve_main(build_app, parser())
