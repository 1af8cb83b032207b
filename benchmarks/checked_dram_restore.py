"""A checked DRAM restore in one process: what ``verify_dram`` (a service's default) costs.

Run: ``.venv/bin/python -m benchmarks.checked_dram_restore [--before DIR] [--pairs 5]
[--kv-planes]``

One ``FlatCakeStore`` with ``verify_dram=True`` holds one DRAM session of ``--pages`` pages x
``--layers`` layers x ``--page-bytes``; each run restores it ``--rounds`` times (byte for
byte checked) and prints the median GB/s beside a memcpy of the same bytes. The destination
is one buffer, pages back to back, or with ``--kv-planes`` vLLM's CPU caches: one
``[2, blocks, 32, heads, 64]`` bf16 tensor per layer seen block first (a page is its block's
K piece and V piece, far apart), the pages into every other block (an engine's small
restore: ``--pages 60 --layers 8 --page-bytes 32KiB`` is the e2e wide model's prefix).
``--before DIR`` (another checkout) runs that tree and this one in alternation, ``--pairs``
times each, in fresh processes, and prints both medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def measure(
    pages: int, layers: int, page_bytes: int, rounds: int, kv_planes: bool = False
) -> tuple[float, float]:
    """(median restore GB/s, memcpy GB/s) in this process."""
    from flatcake_ray.config import PlacementConfig, StoreConfig
    from flatcake_ray.core.catalog import PutHints
    from flatcake_ray.node.store import FlatCakeStore

    nbytes = layers * pages * page_bytes
    kv = np.random.default_rng(7).integers(0, 256, (layers, pages, page_bytes), dtype=np.uint8)
    out = np.zeros_like(kv)
    planes = _KvPlanes(layers, pages, page_bytes) if kv_planes else None
    with tempfile.TemporaryDirectory(dir="/var/tmp") as root:
        config = StoreConfig(
            root=root, layers=layers, page_bytes=page_bytes, dram_bytes=2 * nbytes + (64 << 20),
            ssd_files_per_dir=1, ssd_file_bytes=64 << 20, fsync=False, verify_dram=True,
            placement=PlacementConfig(dram_policy="table2"),
        )  # fmt: skip
        with FlatCakeStore(config) as store:
            keys = [f"k-{i}" for i in range(pages)]
            short_chat = PutHints(turn=2, prior_reply_tokens=1, context_tokens=1)
            if store.put(keys, kv, hints=short_chat).medium.name != "DRAM":
                raise AssertionError("the session did not land in DRAM")
            seconds = []
            for round_ in range(rounds + 1):  # round 0 warms up
                out.fill(0)
                if planes is not None:
                    planes.clear()
                started = time.perf_counter()
                if planes is None:
                    got = store.get(keys, out)
                else:
                    got = store.restore(keys, planes.destination()).wait()
                if round_:
                    seconds.append(time.perf_counter() - started)
                if planes is not None:
                    planes.saved(out)
                if got != pages or not np.array_equal(out, kv):
                    raise AssertionError(f"wrong bytes ({got} pages)")
    started = time.perf_counter()
    np.copyto(out, kv)
    return nbytes / statistics.median(seconds) / 1e9, nbytes / (time.perf_counter() - started) / 1e9


class _KvPlanes:
    """vLLM's CPU KV caches for ``pages`` pages of ``page_bytes``: one K/V-first bf16 tensor
    a layer, seen block first; the restore's pages go into every other block."""

    def __init__(self, layers: int, pages: int, page_bytes: int) -> None:
        import torch

        heads = page_bytes // (2 * 32 * 64 * 2)  # K and V, 32 tokens, head 64, bf16
        if heads < 1 or heads * 2 * 32 * 64 * 2 != page_bytes:
            raise SystemExit("--kv-planes needs --page-bytes a multiple of 8 KiB")
        shape = (2, 2 * pages + 1, 32, heads, 64)
        self.tensors = [
            torch.zeros(shape, dtype=torch.bfloat16).transpose(0, 1) for _ in range(layers)
        ]
        self.blocks = 1 + 2 * np.arange(pages)

    def clear(self) -> None:
        for tensor in self.tensors:
            tensor.zero_()

    def destination(self):
        """Made for each restore, as an engine's connector makes it."""
        from flatcake_ray.restore import LayerTensors

        return LayerTensors(self.tensors, self.blocks)

    def saved(self, out: np.ndarray) -> None:
        """What the restore put in the blocks, as vLLM's connector saves it, into ``out``."""
        import torch

        ids = torch.from_numpy(self.blocks)
        for layer, tensor in enumerate(self.tensors):
            out[layer] = tensor.view(torch.uint8)[ids].reshape(len(ids), -1).numpy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checked_dram_restore")
    parser.add_argument("--pages", type=int, default=3421)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--page-bytes", type=int, default=16 << 10)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--before", help="a checkout run in alternation with this tree")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--kv-planes", action="store_true", help="into vLLM's K/V planes")
    args = parser.parse_args(argv)
    sizes = (args.pages, args.layers, args.page_bytes, args.rounds)
    if not args.before:
        restore, memcpy = measure(*sizes, kv_planes=args.kv_planes)
        print(f"restore {restore:.2f} GB/s, memcpy {memcpy:.2f} GB/s")
        return 0
    from benchmarks.stages import import_tree

    found: dict[str, list[float]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="flatcake-before-") as scratch:
        trees = {"before": import_tree(args.before, scratch), "after": None}
        print(f"load average at the start: {os.getloadavg()[0]:.2f}")
        for _ in range(args.pairs):
            for name, tree in trees.items():
                env = dict(os.environ, **({"PYTHONPATH": tree} if tree else {}))
                command = [sys.executable, "-m", "benchmarks.checked_dram_restore"]
                command += [
                    f"--{k}={v}"
                    for k, v in zip(("pages", "layers", "page-bytes", "rounds"), sizes, strict=True)
                ] + (["--kv-planes"] if args.kv_planes else [])
                cwd = tree or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
                line = subprocess.run(
                    command, env=env, cwd=cwd, capture_output=True, text=True, check=True
                )
                print(name, line.stdout.strip())
                found[name].append(float(line.stdout.split()[1]))
    for name, rates in found.items():
        print(f"{name}: median {statistics.median(rates):.2f} GB/s over {len(rates)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
