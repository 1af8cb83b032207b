"""Restore into CUDA KV memory through the restore pipeline, checked byte-exact and timed.

A :class:`FlatCakeStore` on real files holds one prefix on DRAM (its arena, registered with
cudaHostRegister, so a hit is a cudaMemcpyAsync from the arena) and one on SSD (O_DIRECT into
the pipeline's pinned slots, then copied; with GPUDirect Storage through kvikio where
``GdsSsdTransport.probe()`` finds it, straight into HBM). Each is restored by
``store.restore`` into three CUDA destinations:

- ``vllm_kv_first``: one tensor per layer laid out as vLLM's CUDA attention allocates it,
  ``[2, blocks, block_size, kv_heads, head_dim]`` bf16, seen block first as vLLM hands it to
  a connector (K and V halves of a block are two pieces: ``scatter_pages``);
- ``vllm_block_first``: ``[blocks, 2, block_size, kv_heads, head_dim]`` per layer (one piece
  per block: the page-scatter kernel, each layer as a one-layer pool);
- ``pool_layer_first``: one ``[layers, slots, page]`` pool (``PagedPool``: the kernel).

Blocks are random and distinct. Every destination is filled with a marker first and must equal,
whole, the torch reference (the stored pages placed with plain indexing on the GPU), so a
stray write fails too. Timing: median over ``--repeats`` of submit -> ``wait()`` and a device
synchronize, as GB/s of payload, beside a raw host-to-device copy of the same bytes from a
pinned tensor and from the arena itself (the ceiling of a DRAM hit).

    python benchmarks/gpu_restore.py [--layers 32] [--pages 256] [--json out.json]
    python benchmarks/gpu_restore.py --device cpu --layers 4 --pages 8   # the logic, here

Without a CUDA device (and ``--device cuda``) it prints why and exits 0; a mismatch exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.stage_clock import GPU_STAGES, RESTORE_STAGES, StageClock, medians

BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 16, 8, 128  # vLLM's default block; Llama-8B-like heads
PAGE_SHAPE = (2, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)  # K and V of one block, bf16
MARKER = 0xA5
DRAM, SSD = "dram", "ssd"


def page_bytes() -> int:
    count = 1
    for size in PAGE_SHAPE:
        count *= size
    return count * 2  # bf16


def build_store(root: str, layers: int, pages: int, gds: str):
    from flatcake_ray.config import StoreConfig
    from flatcake_ray.node.store import FlatCakeStore

    prefix_bytes = layers * pages * page_bytes()
    mib = (prefix_bytes >> 20) + 8
    config = StoreConfig(
        root=root,
        layers=layers,
        page_bytes=page_bytes(),
        dram_bytes=mib << 20,
        ssd_files_per_dir=1,
        ssd_file_bytes=mib << 20,
        ssd_min_run_bytes=1 << 20,
        fsync=False,
        gds=gds,
    )
    return FlatCakeStore(config)


def put_prefixes(store, kv) -> dict[str, list[str]]:
    """One prefix per medium (Table 2: a later turn after a short reply -> DRAM; a first turn
    -> SSD); returns the keys of each."""
    from flatcake_ray.node.store import PutHints

    pages = kv.shape[1]
    keys = {medium: [f"{medium}-{i}" for i in range(pages)] for medium in (DRAM, SSD)}
    placed = {
        DRAM: store.put(keys[DRAM], kv, hints=PutHints(turn=2, prior_reply_tokens=10)),
        SSD: store.put(keys[SSD], kv, hints=PutHints(turn=1)),
    }
    for medium, result in placed.items():
        if result.medium.name.lower() != medium:
            raise AssertionError(f"the {medium} prefix went to {result.medium.name}")
    return keys


class Case:
    """One destination kind: its tensors, the restore destination over them, the reference."""

    def __init__(self, name: str, kv, device, blocks: int, seed: int) -> None:
        import torch

        from flatcake_ray.restore.dest import LayerTensors, PagedPool

        layers, pages, nbytes = kv.shape
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randperm(blocks, generator=gen)[:pages]
        self.name = name
        if name == "pool_layer_first":
            self.tensors = [torch.empty((layers, blocks, nbytes), dtype=torch.uint8, device=device)]
            self.views = [self.tensors[0][layer] for layer in range(layers)]
            self.dest: Callable[[], object] = lambda: PagedPool(self.tensors[0], self.ids)
        else:
            kv_first = name == "vllm_kv_first"
            shape = (2, blocks, *PAGE_SHAPE[1:]) if kv_first else (blocks, *PAGE_SHAPE)
            self.tensors = [
                torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(layers)
            ]
            block_first = [t.permute(1, 0, 2, 3, 4) if kv_first else t for t in self.tensors]
            self.views = block_first
            self.dest = lambda: LayerTensors(block_first, self.ids)
        self.reference = self._reference(kv, device)

    def _reference(self, kv, device) -> list:
        """Each layer view as it must be after the restore: the marker, and page i of the
        layer in block ``ids[i]`` (logical row-major bytes, what vLLM's connector saves)."""
        import torch

        expected = []
        for layer, view in enumerate(self.views):
            want = _filled_like(view)
            pages = torch.from_numpy(kv[layer]).to(device)
            want[self.ids.to(device)] = pages.view(view.dtype).reshape(-1, *view.shape[1:])
            expected.append(want)
        return expected

    def reset(self) -> None:
        for tensor in self.tensors:
            _fill_marker(tensor)

    def matches(self) -> bool:
        import torch

        return all(
            torch.equal(_as_bytes(view), _as_bytes(want))
            for view, want in zip(self.views, self.reference, strict=True)
        )


def _as_bytes(tensor):
    import torch

    return tensor.contiguous().view(torch.uint8)


def _fill_marker(tensor) -> None:
    import torch

    tensor.view(torch.uint8).fill_(MARKER)


def _filled_like(view):
    import torch

    want = torch.empty(view.shape, dtype=view.dtype, device=view.device)
    _fill_marker(want)
    return want


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_restore(
    store, keys: list[str], case: Case, device, repeats: int, clock=None
) -> tuple[float, bool, dict[str, float]]:
    """Median seconds of one restore (submit -> every layer in place), whether every repeat
    left the destination equal to the reference, and (with a ``StageClock``) the median ms
    per stage."""
    samples, exact, stages = [], True, []
    for _ in range(repeats):
        case.reset()
        synchronize(device)
        start = time.perf_counter()
        with clock.op(stages) if clock is not None else contextlib.nullcontext():
            restored = store.restore(keys, case.dest()).wait(timeout=600)
            synchronize(device)
        samples.append(time.perf_counter() - start)
        exact = exact and restored == len(keys) and case.matches()
    return statistics.median(samples), exact, medians(stages) if stages else {}


def raw_copies(store, nbytes: int, device, repeats: int) -> dict[str, float]:
    """Seconds of a plain host-to-device copy of ``nbytes``: from a pinned tensor, and from
    the store's arena (registered when CUDA exists) as a DRAM hit reads it."""
    import torch

    if device.type != "cuda":
        return {}
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sources = {
        "pinned": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
        "arena": torch.from_numpy(store.arena.view[:nbytes]),
    }
    timings = {}
    for name, source in sources.items():
        samples = []
        for _ in range(repeats + 1):
            synchronize(device)
            start = time.perf_counter()
            target.copy_(source, non_blocking=True)
            synchronize(device)
            samples.append(time.perf_counter() - start)
        timings[name] = statistics.median(samples[1:])
    return timings


def gds_status() -> str | None:
    """None when GPUDirect Storage (kvikio) is usable, else why not."""
    from flatcake_ray.transports.local_ssd import GdsSsdTransport

    return GdsSsdTransport.probe()


def run(args: argparse.Namespace, device) -> dict:
    import numpy as np

    from flatcake_ray.cuda_ext.scatter import kernel_available

    rng = np.random.default_rng(0)
    kv = rng.integers(0, 256, size=(args.layers, args.pages, page_bytes()), dtype=np.uint8)
    payload = kv.nbytes
    blocks = args.pages * 2  # twice the blocks a prefix needs, so destinations scatter
    cases = [
        Case(name, kv, device, blocks, seed)
        for seed, name in enumerate(("vllm_kv_first", "vllm_block_first", "pool_layer_first"))
    ]
    gds_reason = gds_status() if device.type == "cuda" else "the destination is not a GPU"
    result: dict = {
        "device": _device_name(device),
        "layers": args.layers,
        "pages": args.pages,
        "page_bytes": page_bytes(),
        "payload_mib": round(payload / 2**20, 1),
        "scatter_kernel": kernel_available() if device.type == "cuda" else None,
        "gds": gds_reason or "on",
        "rows": [],
    }
    modes = ["off"] + (["on"] if gds_reason is None else [])
    clock = StageClock(RESTORE_STAGES + GPU_STAGES).install() if args.stages else None
    try:
        _run_modes(args, device, kv, cases, modes, clock, result)
    finally:
        if clock is not None:
            clock.uninstall()
    return result


def _run_modes(args, device, kv, cases, modes, clock, result: dict) -> None:
    payload = kv.nbytes
    with tempfile.TemporaryDirectory(prefix="fc-gpu-restore-", dir=args.root) as root:
        for gds in modes:
            with build_store(root, args.layers, args.pages, gds) as store:
                keys = put_prefixes(store, kv)
                if gds == "off":
                    result["ssd_o_direct"] = store.pool.direct  # else buffered (page cache)
                    raw = raw_copies(store, payload, device, args.repeats)
                    result["raw_gbps"] = {k: round(payload / s / 1e9, 2) for k, s in raw.items()}
                media = (DRAM, SSD) if gds == "off" else (SSD,)
                for medium in media:
                    for case in cases:
                        seconds, exact, stages = time_restore(
                            store, keys[medium], case, device, args.repeats, clock
                        )
                        result["rows"].append(
                            {
                                "medium": medium if gds == "off" else f"{medium}+gds",
                                "dest": case.name,
                                "gbps": round(payload / seconds / 1e9, 2),
                                "ms": round(seconds * 1e3, 2),
                                "byte_exact": exact,
                                "stages_ms": stages,
                            }
                        )
            for path in Path(root).iterdir():  # the next store opens a fresh root
                _remove(path)


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path) if path.is_dir() else path.unlink()


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def print_table(result: dict) -> None:
    print(
        f"\n{result['device']}: {result['layers']} layers x {result['pages']} pages of "
        f"{result['page_bytes']} B = {result['payload_mib']} MiB per restore; scatter kernel: "
        f"{result['scatter_kernel']}; GDS: {result['gds']}; SSD O_DIRECT: "
        f"{result.get('ssd_o_direct')}"
    )
    for name, gbps in result.get("raw_gbps", {}).items():
        print(f"raw host->device copy from {name}: {gbps} GB/s")
    print("{:<10} {:<18} {:>9} {:>10} {:>10}".format("medium", "dest", "GB/s", "ms", "exact"))
    for row in result["rows"]:
        print(
            f"{row['medium']:<10} {row['dest']:<18} {row['gbps']:>9} {row['ms']:>10} "
            f"{row['byte_exact']!s:>10}"
        )
    names = sorted({s for row in result["rows"] for s in row.get("stages_ms", {})} - {"wall"})
    if names:
        print("\nper stage, ms per restore (median; stages on different threads overlap):")
        print("| medium | dest | wall | " + " | ".join(names) + " |")
        print("|---|---|---:|" + "---:|" * len(names))
        for row in result["rows"]:
            stages = row["stages_ms"]
            cells = " | ".join(f"{stages.get(n, 0.0):.2f}" for n in names)
            print(f"| {row['medium']} | {row['dest']} | {stages.get('wall', 0.0):.2f} | {cells} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--pages", type=int, default=256, help="blocks of the prefix")
    parser.add_argument("--repeats", type=int, default=5, help="timings; the median is kept")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (logic only)")
    parser.add_argument("--root", default=None, help="folder for the store (default: tmp)")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument(
        "--stages", action="store_true", help="also time each stage (benchmarks/stages.py)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: GPU restore benchmark skipped (it restores into GPU memory)")
        return 0
    if device.type == "cuda":
        torch.cuda.init()  # before the store opens, so its arena is registered
    result = run(args, device)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if not all(row["byte_exact"] for row in result["rows"]):
        print("MISMATCH: a restore differs from the torch reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
