"""Serve a model with Ray Serve LLM (vLLM) on top of a running FlatCake-Ray service.

    flatcake-ray start ...                      # the service, once per cluster
    python examples/serve_llm.py --model Qwen/Qwen2.5-0.5B-Instruct --namespace flatcake

vLLM attaches through configuration alone: ``kv_transfer_config`` names the connector class
and this package's module path, and vLLM's factory imports it in every engine process (no
registration step). Prefix hits of any replica, on any node, then come from FlatCake-Ray.

PYTHONHASHSEED is set on every replica: vLLM's block hashes (the store's keys) are seeded
from it, so replicas, restarts and other nodes must share one value or they never hit.
"""

from __future__ import annotations

import argparse

from flatcake_ray.integrations.vllm import kv_transfer_config


def build_app(args: argparse.Namespace):
    from ray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app

    llm_config = LLMConfig(
        model_loading_config={"model_id": args.model_id or args.model, "model_source": args.model},
        engine_kwargs={
            "tensor_parallel_size": args.tp,
            "enable_prefix_caching": True,
            "kv_transfer_config": kv_transfer_config(
                store="ray",
                ray_namespace=args.namespace,
                load_async=args.load_async,  # auto: SSD hits load between steps
            ),
        },
        runtime_env={"env_vars": {"PYTHONHASHSEED": args.hash_seed}},
        deployment_config={
            "autoscaling_config": {"min_replicas": 1, "max_replicas": args.replicas}
        },
        accelerator_type=args.accelerator,
    )
    return build_openai_app(LLMServingArgs(llm_configs=[llm_config]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face id or local folder")
    parser.add_argument("--model-id", help="the name clients ask for (default: --model)")
    parser.add_argument("--namespace", default="flatcake", help="Ray namespace of the service")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--accelerator", default=None, help="e.g. H100; None: any GPU")
    parser.add_argument("--load-async", default="auto", choices=("auto", "always", "never"))
    parser.add_argument("--hash-seed", default="0", help="PYTHONHASHSEED of every replica")
    args = parser.parse_args()

    import ray
    from ray import serve

    from flatcake_ray.client.client import FlatCakeClient

    ray.init(address="auto", namespace=args.namespace)
    FlatCakeClient(args.namespace).close()  # fails fast (ServiceError) without a service
    serve.run(build_app(args), blocking=True)


if __name__ == "__main__":
    main()
