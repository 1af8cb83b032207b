"""Page-scatter throughput on one CUDA GPU.

For each layout and page size, one layer of ``--layer-mib`` MiB of staged pages is scattered
into random slots of a paged pool, by the nvcc-built kernel and by the torch reference
(``index_copy_``), and compared with a device-to-device copy of the same bytes (the ceiling
for any scatter) and with the host-to-device copy of one layer from pinned memory into the
staging window (what a restore without GPUDirect Storage pays first). GB/s are 1e9 bytes of
payload per second; ``--repeat`` calls are queued between two CUDA events so launch overhead
is hidden as it is in a pipelined restore.

    python benchmarks/scatter_bench.py [--layer-mib 256] [--json results.json]

Without a CUDA device it prints why and exits 0; without a built kernel it exits 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from flatcake_ray.cuda_ext import _library
from flatcake_ray.cuda_ext.scatter import LAYOUTS, kernel_available, scatter_layer

# page bytes -> what such a page is
PAGE_SIZES = {
    2048: "1-token page, 8 KV heads x 128 x fp16 (SGLang page_size=1, K or V)",
    2050: "odd 2050 B page (byte-copy path)",
    32768: "16-token block, 8 KV heads x 128 x fp16 (vLLM default block)",
    131072: "256-token page, 2 KV heads x 128 x fp16 (paper page, Llama-70B TP4)",
}
POOL_LAYERS = 2
SLOTS_PER_PAGE = 2  # pool has twice the slots a layer needs, so destinations scatter


def gbps(payload_bytes: int, milliseconds: float) -> float:
    return payload_bytes / (milliseconds * 1e-3) / 1e9


def time_ms(work: Callable[[], None], repeat: int, trials: int) -> float:
    """Median over ``trials`` of the GPU time of ``repeat`` queued calls, per call."""
    for _ in range(2):
        work()
    torch.cuda.synchronize()
    samples = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            work()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / repeat)
    return statistics.median(samples)


def bench_layout(layout: str, page_bytes: int, layer_bytes: int, args) -> dict:
    pages = layer_bytes // page_bytes
    payload = pages * page_bytes
    slots = pages * SLOTS_PER_PAGE
    outer = (POOL_LAYERS, slots) if layout == "layer_first" else (slots, POOL_LAYERS)
    pool = torch.empty((*outer, page_bytes), dtype=torch.uint8, device="cuda")
    staging = torch.randint(0, 256, (payload,), dtype=torch.uint8, device="cuda")
    slot_ids = torch.randperm(slots, device="cuda")[:pages]
    copy_target = torch.empty_like(staging)

    def run(backend: str) -> Callable[[], None]:
        return lambda: scatter_layer(
            staging, pool, slot_ids, 1, layout, check_slots=False, backend=backend
        )

    kernel_ms = time_ms(run("kernel"), args.repeat, args.trials)
    torch_ms = time_ms(run("torch"), args.repeat, args.trials)
    d2d_ms = time_ms(lambda: copy_target.copy_(staging), args.repeat, args.trials)
    return {
        "layout": layout,
        "page_bytes": page_bytes,
        "pages": pages,
        "kernel_gbps": round(gbps(payload, kernel_ms), 1),
        "torch_gbps": round(gbps(payload, torch_ms), 1),
        "d2d_copy_gbps": round(gbps(payload, d2d_ms), 1),
        "kernel_vs_d2d": round(d2d_ms / kernel_ms, 3),
        "kernel_vs_torch": round(torch_ms / kernel_ms, 2),
    }


def bench_h2d(layer_bytes: int, args) -> float:
    host = torch.empty(layer_bytes, dtype=torch.uint8, pin_memory=True)
    staging = torch.empty(layer_bytes, dtype=torch.uint8, device="cuda")
    ms = time_ms(lambda: staging.copy_(host, non_blocking=True), args.repeat, args.trials)
    return round(gbps(layer_bytes, ms), 1)


def print_table(result: dict) -> None:
    print(
        f"\n{result['device']}, layer {result['layer_mib']} MiB, "
        f"H2D pinned -> staging {result['h2d_gbps']} GB/s"
    )
    header = ("layout", "page B", "pages", "kernel", "torch", "D2D copy", "kern/D2D")
    print("{:<12} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9}".format(*header))
    for row in result["rows"]:
        print(
            f"{row['layout']:<12} {row['page_bytes']:>8} {row['pages']:>8} "
            f"{row['kernel_gbps']:>9} {row['torch_gbps']:>9} {row['d2d_copy_gbps']:>9} "
            f"{row['kernel_vs_d2d']:>9}"
        )
    print("(GB/s of payload; kern/D2D = kernel throughput as a fraction of a plain copy)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer-mib", type=int, default=256, help="bytes of one layer, MiB")
    parser.add_argument("--page-bytes", type=int, action="append", help="repeatable")
    parser.add_argument("--repeat", type=int, default=10, help="calls queued per timing")
    parser.add_argument("--trials", type=int, default=7, help="timings; the median is kept")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: scatter benchmark skipped (it measures GPU copies only)")
        return 0
    if not kernel_available():
        print(
            f"scatter kernel not usable: {_library.load().reason}; build it with "
            "`python -m flatcake_ray.cuda_ext.build`",
            file=sys.stderr,
        )
        return 1
    layer_bytes = args.layer_mib << 20
    rows = [
        bench_layout(layout, page_bytes, layer_bytes, args)
        for page_bytes in (args.page_bytes or PAGE_SIZES)
        for layout in LAYOUTS
    ]
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kernel_library": str(_library.load().library.path),
        "layer_mib": args.layer_mib,
        "h2d_gbps": bench_h2d(layer_bytes, args),
        "page_kinds": {
            str(size): PAGE_SIZES.get(size, "custom") for size in (args.page_bytes or PAGE_SIZES)
        },
        "rows": rows,
    }
    print_table(result)
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
