"""TTFT of a request whose long prefix is restored from FlatCake-Ray, vLLM on CPU.

``.venv-e2e/bin/python benchmarks/e2e_ttft.py [--repeats 11] [--write-md BENCHMARKS.md]``

A correctness-and-overhead figure for the real vLLM connector path, not a GPU result: random-
weight Llamas on 1-2 CPU threads, so prefill is cheap and the figure shows what a restore
costs against it. Two geometries (``--shapes``): the e2e suite's tiny model (3 layers, 8 KiB
pages) and ``wide`` (8 layers, hidden 512, 4 KV heads, 32 KiB pages: 10x the bytes per
token). Two stores: in-process (``store: local``) and ``store: ray`` (a one-node Ray cluster
on 127.0.0.1 this script starts, with the FlatCake service on it; its address is passed).
One engine per geometry and store, engine core in this process; per repeat, side by side on
one prompt of ``prefix + new`` tokens:

- recompute: the engine computes the whole prompt (a miss everywhere);
- vLLM prefix cache: the same prompt again, the prefix a hit in the engine's own cache;
- FlatCake DRAM / SSD hit, in each ``load_async`` mode (auto, always, never): the engine's
  prefix cache reset, the prefix it saved earlier comes from FlatCake (placed on DRAM or
  SSD by the write-time hints; the stores run ``dram_policy: table2``, so an SSD hit reads
  SSD, not a DRAM replica). The mode is the scheduler side's ``load_policy``, switched
  between rounds (the value ``load_async`` sets);
- cross-node (``--cross-node``): an engine on node 2 of a local 2-node Ray cluster restores
  a prefix that an engine on node 1 saved, through the FlatCake-Ray service (remote path);
- native offloading (``benchmarks/e2e_native.py``; ``--skip-native`` leaves it out; it runs
  only where vLLM's OffloadingConnector does, a CUDA or XPU device, and says so otherwise):
  a fresh engine's empty CPU tier promotes the prefix from FlatCake-Ray as the tier below
  it, or from vLLM's ``fs`` tier there; then the same prompt is a hit in the CPU tier itself.

Targets (issue 22): a DRAM hit <= 1.3x the engine's own prefix-cache hit; an SSD hit <= that
plus the prefix's bytes at the O_DIRECT read rate measured beside the run. TTFT is the wall
time of an offline ``generate`` with ``max_tokens=1``; medians of ``--repeats`` distinct
prefixes; the load average is printed before and after. Every restored request is checked:
whole prefix reported cached, first token equal to the recomputed one. ``--write-md`` refuses
(says why, exits 2, leaves the file alone) as bench-peers does: a run that started above load
average 1.5, or whose O_DIRECT read rate beside one geometry fell more than 20% below the
other's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
# SSD homes without DRAM read replicas: an SSD hit reads SSD (both stores read FLATCAKE_*;
# the Ray nodes started below inherit it).
os.environ.setdefault("FLATCAKE_DRAM_POLICY", "table2")

from benchmarks.e2e_native import (  # noqa: E402
    check_native,
    native_tiers,
    native_unsupported,
    write_native_markdown,
)
from benchmarks.e2e_report import (  # noqa: E402
    bounds,
    check,
    load_average,
    prefix_bytes,
    refusal,
    report,
    ssd_read_gbps,
    summarize,
    write_markdown,
)
from flatcake_ray.cli import benchkit  # noqa: E402
from tests.e2e import engines  # noqa: E402
from tests.e2e.engines import BLOCK  # noqa: E402
from tests.e2e.tiny_model import TINY, WIDE, Shape, words, write_tiny_llama  # noqa: E402

DRAM = {"flatcake_turn": 2, "flatcake_prior_reply_tokens": 16}
SSD = {"flatcake_turn": 1}
HINTS = {"dram": DRAM, "ssd": SSD}
MODES = ("auto", "always", "never")
SHAPES = {"tiny": TINY, "wide": WIDE}
RAY_NAMESPACE = "fc-bench-e2e"


def ttft(llm, prompt: list[int], kv_params: dict | None = None) -> tuple[float, int, int]:
    """Seconds to the first token, cached tokens, the first token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": kv_params} if kv_params else None
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args=extra)
    started = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    return (
        time.perf_counter() - started,
        int(out.num_cached_tokens or 0),
        out.outputs[0].token_ids[0],
    )


class Prompts:
    def __init__(self, prefix_tokens: int, new_tokens: int) -> None:
        self.prefix_tokens, self.new_tokens = prefix_tokens, new_tokens

    def prefix(self, kind: str, repeat: int) -> list[int]:
        # words() walks a cycle of 997 ids: offsets must differ modulo 997 to differ at all
        kind_offset = {"dram": 1, "ssd": 2, "own": 3, "miss": 4, "xnode": 5, "xmiss": 6}[kind]
        return words(self.prefix_tokens, 150 * kind_offset + 13 * repeat)

    def prompt(self, kind: str, repeat: int) -> list[int]:
        return self.prefix(kind, repeat) + words(self.new_tokens, 7 + 11 * repeat)


# ---- what one engine measures, one function per case ---------------------------------------
def recompute(llm, prompts: Prompts, repeat: int) -> tuple[float, int, int]:
    """A miss everywhere: a prompt neither the engine nor FlatCake has seen."""
    return ttft(llm, prompts.prompt("miss", repeat))


def vllm_prefix_cache(llm, prompts: Prompts, repeat: int) -> tuple[float, int, int]:
    """The prompt ``recompute`` just ran, again: its prefix is in the engine's own cache."""
    return ttft(llm, prompts.prompt("miss", repeat))


def flatcake_hit(llm, prompts: Prompts, repeat: int, kind: str) -> tuple[float, int, int]:
    """The engine's prefix cache reset, the prefix (saved earlier) comes from FlatCake."""
    llm.reset_prefix_cache()
    return ttft(llm, prompts.prompt(kind, repeat))


def set_load_mode(llm, mode: str) -> None:
    """What ``load_async`` sets, on the running engine (its engine core is in this process)."""
    llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side.load_policy = mode


def measure(llm, prompts: Prompts, repeats: int, modes: tuple[str, ...]) -> dict[str, list]:
    """Every case, side by side in one engine, ``repeats`` distinct prefixes."""
    results: dict[str, list] = {"recompute": [], "vllm prefix cache": []}
    ttft(llm, prompts.prompt("miss", repeats))  # warm-up, not counted
    for r in range(repeats):
        for kind, hints in HINTS.items():  # saved now, read back below
            ttft(llm, prompts.prefix(kind, r), hints)
        results["recompute"].append(recompute(llm, prompts, r))
        results["vllm prefix cache"].append(vllm_prefix_cache(llm, prompts, r))
        # The first hit of a repeat follows its saves, whose SSD writes may still run on the
        # node (over Ray): each mode takes that place in turn, not always the first one.
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            set_load_mode(llm, mode)
            for kind in HINTS:
                results.setdefault(f"{kind} {mode}", []).append(flatcake_hit(llm, prompts, r, kind))
    return results


# ---- one function per store ----------------------------------------------------------------
@contextlib.contextmanager
def one_process_engine_core() -> Iterator[dict]:
    """vLLM's engine core and its worker in this process (the ``uni`` executor)."""
    import vllm.envs

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    vllm.envs.disable_envs_cache()
    try:
        yield {"distributed_executor_backend": "uni"}
    finally:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
        vllm.envs.disable_envs_cache()


def run_engine(model: str, options: dict, measure_fn: Callable) -> dict[str, list]:
    from vllm import LLM

    from flatcake_ray.integrations.vllm import kv_transfer_config

    with one_process_engine_core() as executor:
        config = kv_transfer_config(**options)
        llm = LLM(
            **engines.engine_args(
                model, enable_prefix_caching=True, kv_transfer_config=config, **executor
            )
        )
        try:
            return measure_fn(llm)
        finally:
            engines.shutdown(llm)


def in_process_store(model: str, shape: Shape, root: Path, measure_fn: Callable) -> dict:
    """``store: local``: the store lives in the engine's process."""
    from tests.e2e.conftest import store_options

    options = store_options(root, store_dram_bytes="256MiB", store_ssd_file_bytes="256MiB")
    return run_engine(model, options, measure_fn)


def ray_store(model: str, shape: Shape, root: Path, measure_fn: Callable) -> dict:
    """``store: ray``: the FlatCake service on a one-node Ray cluster started here."""
    with ray_service(shape, root) as address:
        options = {"store": "ray", "ray_namespace": RAY_NAMESPACE, "ray_address": address}
        return run_engine(model, options, measure_fn)


@contextlib.contextmanager
def ray_service(shape: Shape, root: Path) -> Iterator[str]:
    """A one-node Ray cluster on 127.0.0.1 (its own temp folder) with the service on it."""
    import ray

    from flatcake_ray.client import deploy
    from tests.e2e.conftest import _start_head, service_config

    temp = Path(tempfile.mkdtemp(prefix="fcb-", dir="/tmp"))
    head = {"num_cpus": 2, "include_dashboard": False, "temp_dir": str(temp / "h")}
    cluster = _start_head(head)
    try:
        ray.init(address=cluster.address, namespace=RAY_NAMESPACE, log_to_driver=False)
        config = service_config(root, RAY_NAMESPACE, shape, store_bytes=256 << 20)
        deploy.start(config, address=cluster.address)
        try:
            yield cluster.address
        finally:
            deploy.stop(RAY_NAMESPACE)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


STORES = {"in-process": in_process_store, "ray": ray_store}


def cross_node(model: str, root: Path, prompts: Prompts, repeats: int) -> dict[str, list]:
    """Engine A (this process, node 1) saves; engine C (an actor on node 2) restores."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from vllm import LLM

    from flatcake_ray.integrations.vllm import kv_transfer_config
    from tests.e2e.conftest import two_node_cluster

    namespace = "fc-bench-e2e"
    results: dict[str, list] = {"cross-node recompute": [], "cross-node": []}
    with two_node_cluster(root, namespace) as cluster:
        ray_options = {"store": "ray", "ray_namespace": namespace}
        config = kv_transfer_config(**ray_options, ray_address=cluster["address"])
        llm = LLM(
            **engines.engine_args(model, enable_prefix_caching=True, kv_transfer_config=config)
        )
        for r in range(repeats):
            ttft(llm, prompts.prefix("xnode", r), DRAM)
        llm.llm_engine.engine_core.shutdown()
        strategy = NodeAffinitySchedulingStrategy(cluster["worker"], soft=False)
        actor = (
            ray.remote(TtftActor)
            .options(num_cpus=1, scheduling_strategy=strategy)
            .remote(
                engines.engine_args(
                    model,
                    enable_prefix_caching=False,
                    kv_transfer_config=kv_transfer_config(**ray_options),
                )
            )
        )
        try:
            ray.get(actor.ttft.remote(prompts.prompt("xmiss", repeats)), timeout=900)
            for r in range(repeats):
                miss = ray.get(actor.ttft.remote(prompts.prompt("xmiss", r)), timeout=300)
                hit = ray.get(actor.ttft.remote(prompts.prompt("xnode", r)), timeout=300)
                results["cross-node recompute"].append(miss)
                results["cross-node"].append(hit)
        finally:
            ray.get(actor.shutdown.remote(), timeout=120)
            ray.kill(actor)
    return results


class TtftActor:
    def __init__(self, args: dict) -> None:
        from vllm import LLM

        self.llm = LLM(**args)

    def ttft(self, prompt: list[int]) -> tuple[float, int, int]:
        return ttft(self.llm, prompt)

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--prefix-tokens", type=int, default=1920)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--stores", nargs="+", choices=list(STORES), default=list(STORES))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--cross-node", action="store_true", help="also the 2-node Ray row")
    parser.add_argument("--skip-native", action="store_true", help="no native-offloading rows")
    parser.add_argument("--write-md", default=None)
    args = parser.parse_args()
    if args.prefix_tokens % BLOCK or args.new_tokens >= BLOCK:
        parser.error(f"--prefix-tokens must be whole blocks of {BLOCK}, --new-tokens under one")
    prompts = Prompts(args.prefix_tokens, args.new_tokens)
    run: dict = {"summaries": {}, "limits": {}, "load": [load_average()], "read_gbps": {}}
    run["load_before"] = benchkit.load_average()
    print(f"load average at start: {run['load'][0]}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fc-bench-e2e-") as tmp:
        for shape_name in args.shapes:
            shape = SHAPES[shape_name]
            model = str(write_tiny_llama(Path(tmp) / shape_name, shape=shape))
            read_gbps = ssd_read_gbps(shape, prompts, Path(tmp) / "limit")
            run["read_gbps"][shape_name] = read_gbps
            for store_name in args.stores:
                config = f"{shape_name}, {store_name}"
                root = Path(tmp) / f"{shape_name}-{store_name}"
                measure_fn = lambda llm: measure(llm, prompts, args.repeats, tuple(args.modes))  # noqa: E731
                results = STORES[store_name](model, shape, root, measure_fn)
                if args.cross_node and store_name == "ray" and shape is TINY:
                    results.update(cross_node(model, root / "x", prompts, args.repeats))
                summary = summarize(results)
                check(summary, prompts, tuple(HINTS))
                limit = bounds(summary, prefix_bytes(shape, prompts), read_gbps)
                run["summaries"][config], run["limits"][config] = summary, limit
                print("\n".join(report(config, summary, limit)), flush=True)
        native = None if args.skip_native else run_native(Path(tmp), prompts, args.repeats)
    run["load"].append(load_average())
    print(f"load average at the end: {run['load'][1]}", flush=True)
    if args.write_md:
        if reasons := refusal(run):
            print(f"NOT writing {args.write_md}: rerun on a quiet machine.", file=sys.stderr)
            for reason in reasons:
                print(f"  {reason}", file=sys.stderr)
            return 2
        command = ".venv-e2e/bin/python " + " ".join(["benchmarks/e2e_ttft.py", *sys.argv[1:]])
        write_markdown(args.write_md, run, prompts, args.repeats, command)
        if native:
            write_native_markdown(args.write_md, native, command)
    return 0


def run_native(tmp: Path, prompts: Prompts, repeats: int) -> dict[str, dict] | None:
    """The native-offloading rows on the tiny model, where vLLM can run them."""
    why_not = native_unsupported()
    if why_not:
        print(f"native offloading rows skipped: {why_not}", flush=True)
        return None
    model = str(write_tiny_llama(tmp / "native-model", shape=TINY))
    summary = summarize(native_tiers(model, tmp / "native", prompts, repeats, ttft))
    check_native(summary, prompts)
    for name, row in summary.items():
        print(f"{name:24s} {row['median_ms']:9.1f} ms  cached={row['cached']}", flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(main())
