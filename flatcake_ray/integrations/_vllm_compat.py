"""What differs between the vLLM versions the connector supports (0.32 and 0.33), and the
checks that depend on how vLLM was configured rather than on the connector's options.

- Block-hash seeds. The store's keys are vLLM's block hashes, chained from ``NONE_HASH``.
  vLLM 0.32 and 0.33 seed ``NONE_HASH`` from ``PYTHONHASHSEED`` when it is set; when it is
  not, the sha256 algorithms (``sha256``, the default, and ``sha256_cbor``) use a fixed seed,
  while the xxhash ones draw a random seed per process. Older vLLM (without
  ``resolve_none_hash_seed``) drew a random seed for every algorithm. So: with sha256 the
  seed needs fixing only in that every engine must agree (set it to one value everywhere, or
  nowhere); with xxhash, or on older vLLM, it must be set, to one value, on every node.
- Process layout. vLLM runs its scheduler and its workers in separate processes under the
  multi-process (``mp``) and Ray executors; an in-process store lives in one process, so
  those layouts reach one store through the Ray service (``store: ray``).
"""

from __future__ import annotations

import os
from typing import Any

from flatcake_ray.errors import ConfigError

UNSEEDED_HASHES = ("xxhash", "xxhash_cbor")
# Executors that keep the scheduler and every worker in one process.
SINGLE_PROCESS_EXECUTORS = ("uni",)


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def fixed_seed_without_env() -> bool:
    """Whether this vLLM gives the sha256 hashes a fixed seed when PYTHONHASHSEED is unset."""
    from vllm.v1.core import kv_cache_utils

    return hasattr(kv_cache_utils, "resolve_none_hash_seed")


def hash_seed_problem(algo: str, env: dict[str, str] | None = None) -> str | None:
    """Why block hashes would differ between processes, or None when they agree."""
    env = os.environ if env is None else env
    if env.get("PYTHONHASHSEED") is not None:
        return None
    if algo in UNSEEDED_HASHES:
        return f"prefix_caching_hash_algo={algo} seeds block hashes at random per process"
    if not fixed_seed_without_env():
        return f"vLLM {vllm_version()} seeds block hashes at random per process"
    return None


def check_hash_seed(vllm_config: Any) -> None:
    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    problem = hash_seed_problem(algo)
    if problem is not None:
        raise ConfigError(
            f"{problem} unless PYTHONHASHSEED is set: no other engine, and no restart of this "
            "one, could ever hit. Set PYTHONHASHSEED to one value on every node (or use "
            "prefix_caching_hash_algo=sha256 on vLLM >= 0.32)"
        )


def executor_backend(vllm_config: Any) -> str:
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend is None:
        return "uni" if vllm_config.parallel_config.world_size == 1 else "mp"
    return backend if isinstance(backend, str) else getattr(backend, "__name__", str(backend))


def check_store_layout(vllm_config: Any, store_kind: str) -> None:
    """An in-process store needs the scheduler and the workers in one process."""
    if store_kind != "local":
        return
    backend = executor_backend(vllm_config)
    if backend not in SINGLE_PROCESS_EXECUTORS:
        raise ConfigError(
            f"store: local (an in-process store) cannot serve vLLM's {backend!r} executor, whose "
            "scheduler and workers run in separate processes: use store: ray (a FlatCake-Ray "
            "service started with `flatcake-ray start`), or keep vLLM's engine in one process "
            "(distributed_executor_backend='uni', one worker)"
        )
