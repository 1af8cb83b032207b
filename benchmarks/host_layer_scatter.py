"""What a restore's destination costs on the host: one KV tensor per layer, either vLLM's
K/V-first CPU caches (``[2, blocks, block, heads, head]`` seen block first: a page in two
pieces) or blocks in one piece (``[blocks, page]``), a ``LayerTensors`` made for the
restore and one scatter per layer of ``--pages`` staged pages into scattered blocks, as the
restore pipeline does for an engine's small restore. Milliseconds per restore, the
median of ``--trials`` timings of ``--repeat`` restores each; ``--before DIR`` times another
checkout (``git worktree add DIR <commit>``, its C extensions copied in) in alternation with
this tree.

    .venv/bin/python -m benchmarks.host_layer_scatter [--layers 3] [--pages 60] [--before DIR]
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


def measure(layers: int, pages: int, repeat: int, trials: int, split: bool) -> float:
    import torch

    from flatcake_ray.cuda_ext.scatter import scatter_layer
    from flatcake_ray.restore.dest import LayerTensors

    if split:  # 8 KiB pages, two 4 KiB pieces
        planes = [torch.zeros(2, 2000, 32, 128, dtype=torch.uint8) for _ in range(layers)]
        tensors = [plane.transpose(0, 1) for plane in planes]
    else:
        tensors = [torch.zeros(2000, 8192, dtype=torch.uint8) for _ in range(layers)]
    staged = torch.from_numpy(np.random.default_rng(0).integers(0, 256, pages * 8192, np.uint8))
    blocks, positions = 100 + 3 * np.arange(pages), np.arange(pages)  # scattered blocks

    def restore() -> None:
        dest = LayerTensors(tensors, blocks)
        for layer in range(layers):
            dest.scatter(staged, positions, layer, scatter_layer)

    for _ in range(repeat):
        restore()
    times = []
    for _ in range(trials):
        started = time.perf_counter()
        for _ in range(repeat):
            restore()
        times.append((time.perf_counter() - started) / repeat * 1e3)
    got = tensors[-1][torch.from_numpy(blocks)].reshape(-1).numpy()  # logical page order
    if not np.array_equal(got, staged.numpy()):
        raise AssertionError("a page landed wrong")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--pages", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--before", default=None, help="a checkout to time in alternation")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        shape = (args.layers, args.pages, args.repeat, args.trials)
        print(measure(*shape, split=True), measure(*shape, split=False))
        return
    command = [sys.executable, "-m", "benchmarks.host_layer_scatter", "--child"]
    command += ["--layers", str(args.layers), "--pages", str(args.pages)]
    command += ["--repeat", str(args.repeat), "--trials", str(args.trials)]
    trees = {"this tree": None}
    with tempfile.TemporaryDirectory(prefix="flatcake-scatter-") as scratch:
        if args.before:
            from benchmarks.stages import import_tree

            trees = {"before": import_tree(args.before, scratch), **trees}
        found: dict[str, list[list[float]]] = {name: [] for name in trees}
        for _ in range(2 if args.before else 1):
            for name, path in trees.items():
                env = dict(os.environ, **({"PYTHONPATH": path} if path else {}))
                done = subprocess.run(
                    command, cwd=path, env=env, capture_output=True, text=True, check=True
                )
                last = done.stdout.strip().splitlines()[-1]
                found[name].append([float(value) for value in last.split()])
    print(f"{args.pages} pages x {args.layers} layers of 8 KiB, ms a restore:")
    for column, layout in enumerate(("K/V-first (two pieces)", "one piece a block")):
        for name, runs in found.items():
            values = " / ".join(f"{run[column]:.3f}" for run in runs)
            print(f"  {layout}, {name}: {values}")


if __name__ == "__main__":
    main()
