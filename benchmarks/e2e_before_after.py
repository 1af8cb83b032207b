"""vLLM's TTFT with the prefix from FlatCake, another checkout against this tree in alternation
(before, after, before, after, ...), so that a change's effect is read against the same
moments of a noisy machine: one ``make bench-e2e`` cell moves by 20-40% from run to run.

Run: ``VLLM_TARGET_DEVICE=cpu .venv-e2e/bin/python -m benchmarks.e2e_before_after --before DIR
[--pairs 3] [e2e_ttft options]`` with DIR a checkout of the code before (``git worktree add
DIR <commit>``; its C extensions built in place: ``python setup.py build_ext --inplace``).
The measuring scripts are this tree's (``benchmarks/e2e_ttft.py`` and the e2e suite's engine
helpers), the code measured is DIR's or this tree's. Default rows: in-process, every shape,
``load_async`` auto and never.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from benchmarks.stages import import_tree

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ROWS = ["--stores", "in-process", "--modes", "auto", "never", "--skip-native"]


def run_once(pythonpath: str | None, extra: list[str]) -> list[str]:
    """One ``e2e_ttft`` run; its result lines (the cells)."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    cwd = pythonpath or HERE
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    script = os.path.join(cwd, "benchmarks", "e2e_ttft.py")
    done = subprocess.run(
        [sys.executable, script, *extra], cwd=cwd, env=env, capture_output=True, text=True
    )
    if done.returncode:
        return [f"(failed: {done.stderr.strip().splitlines()[-1:]})"]
    return [line for line in done.stdout.splitlines() if " ms " in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="a checkout of the code before")
    parser.add_argument("--pairs", type=int, default=3)
    args, extra = parser.parse_known_args()
    extra = extra or ["--repeats", "5", *DEFAULT_ROWS]
    print(f"load average at the start: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="flatcake-e2e-before-") as scratch:
        before = import_tree(args.before, scratch)
        shutil.copytree(os.path.join(HERE, "tests"), os.path.join(scratch, "tests"))
        for pair in range(1, args.pairs + 1):
            for name, path in (("before", before), ("after", None)):
                print(f"=== {name} {pair}")
                print("\n".join(run_once(path, extra)), flush=True)
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
