"""Where a FlatCake hit's TTFT goes in a real vLLM: ``benchmarks/e2e_ttft.py``'s run with the
connector's, the restore's and vLLM's own functions timed from outside (``StageClock``).

``.venv-e2e/bin/python benchmarks/e2e_stages.py --shapes wide --stores ray --modes never``
(any ``e2e_ttft.py`` flags, one shape and one store a run: the stages are kept per request
kind; for a before/after, run it from the other checkout in alternation).

Prints, beside ``e2e_ttft``'s table, the median milliseconds of each stage per request kind:
``own`` (vLLM's own prefix-cache hit), ``dram`` and ``ssd`` (FlatCake hits); a stage is the
wall time of every call to its functions during one request, summed over threads (the loads
of later layers run beside the forward pass, so stages overlap).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import benchmarks.e2e_ttft as e2e  # noqa: E402
from benchmarks.stage_clock import RESTORE_STAGES, StageClock, medians  # noqa: E402

SCHEDULER = "flatcake_ray.integrations._vllm_scheduler"
WORKER = "flatcake_ray.integrations._vllm_worker"
RUNNER = "vllm.v1.worker.gpu_model_runner"
ENGINE_STAGES = (
    ("sched.matched", SCHEDULER, "SchedulerSide.get_num_new_matched_tokens"),
    ("sched.probe", "flatcake_ray.client.client", "FlatCakeClient.probe"),
    ("worker.start_loads", WORKER, "WorkerSide.start_loads"),
    ("worker.wait_layer", WORKER, "WorkerSide.wait_for_layer_load"),
    ("worker.save_layer", WORKER, "WorkerSide.save_kv_layer"),
    ("restore.start", "flatcake_ray.restore.pipeline", "RestorePipeline._job"),
    ("restore.start.access", "flatcake_ray.client.source", "TransportSource.access"),
    ("vllm.schedule", "vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
    ("vllm.execute_model", RUNNER, "GPUModelRunner.execute_model"),
)


def main() -> int:
    clock = StageClock(RESTORE_STAGES + ENGINE_STAGES)
    rows: dict[str, list[dict[str, float]]] = {}

    def timed(llm, kind: str, prompt: list[int]) -> tuple[float, int, int]:
        clock.install()
        try:
            with clock.op(rows.setdefault(kind, [])):
                return e2e.ttft(llm, prompt)
        finally:
            clock.uninstall()

    def flatcake_hit(llm, prompts, repeat: int, kind: str):
        llm.reset_prefix_cache()
        return timed(llm, kind, prompts.prompt(kind, repeat))

    def vllm_prefix_cache(llm, prompts, repeat: int):
        return timed(llm, "own", prompts.prompt("miss", repeat))

    e2e.flatcake_hit, e2e.vllm_prefix_cache = flatcake_hit, vllm_prefix_cache
    sys.argv = [sys.argv[0], "--skip-native", *sys.argv[1:]]
    code = e2e.main()
    for kind, measured in rows.items():
        stages = medians(measured)
        shown = ", ".join(f"{name} {ms:.2f}" for name, ms in stages.items() if ms >= 0.05)
        print(f"stages, {kind} ({len(measured)} requests, median ms): {shown}")
    return code


if __name__ == "__main__":
    sys.exit(main())
