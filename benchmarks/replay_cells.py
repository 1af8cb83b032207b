"""Single runs of chosen goal cells of ``replay_sweep.py``, each written as it finishes.

For a machine where a whole section does not fit the time there is: every (cell, system,
load, seed) is one task, its run saved to ``--out/<cell>/<system>-<load>-<seed>.json`` at
once, and ``--table`` prints the goal table of what is saved, completed (where ``--saved``
holds a sweep's runs) by the sweep's runs of the baselines (``BASELINES``) not rerun here on
the same cell, load and seed.

Run: ``.venv/bin/python benchmarks/replay_cells.py --runs agentic-tight:1.0,agentic-roomy:1.0
--systems flatcake --seeds 0 [--jobs 2]``, then ``... --table``.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_sweep import PROFILE, ROOMY, TIGHT, synthetic

from flatcake_ray.replay import run_comparison
from flatcake_ray.replay.goal import goal_rows, goal_table
from flatcake_ray.replay.sweep import _summaries

CELLS = {  # the agentic goal cells of replay_sweep.py, same trace and capacities
    "agentic-tight": TIGHT,
    "agentic-roomy": ROOMY,
    "commodity-2drive": {**TIGHT, "ssd_drives": 2},
    "commodity-1drive": {**TIGHT, "ssd_drives": 1},
}


# Saved runs of these are taken as they are (their code is unchanged since the sweep ran);
# FlatCake variants and the oracle share the code under test and are only shown when rerun.
BASELINES = ("dram-only", "tiered", "tiered-tuned", "tiered-aware", "tiered-gds")


def run_cell(cell: str, system: str, load: float, seed: int, out: Path) -> str:
    trace = synthetic("agentic", 0.01)
    result = run_comparison(
        trace, (system,), PROFILE, (load,), (seed,), profile_overrides=CELLS[cell], progress=False
    )
    path = out / cell / f"{system}-{load:g}-{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result["runs"][0], default=str))
    return f"{cell} {system} {load:g} seed {seed}: {result['runs'][0]['wall_s']:.0f} s"


def table(out: Path, saved: Path) -> str:
    rows = []
    for cell_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        fresh = [json.loads(p.read_text()) for p in sorted(cell_dir.glob("*.json"))]
        saved_file = saved / cell_dir.name / "result.json"
        old = json.loads(saved_file.read_text())["runs"] if saved_file.exists() else []
        rerun = {run["system"] for run in fresh}
        keys = {(run["x"], run["seed"]) for run in fresh}
        others = [
            r
            for r in old
            if r["system"] not in rerun and r["system"] in BASELINES and (r["x"], r["seed"]) in keys
        ]
        summary = _summaries(fresh + others)
        rows += goal_rows(cell_dir.name, {"summary": summary})
    return goal_table(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="", help="cell:load,... (cells: " + ",".join(CELLS))
    parser.add_argument("--systems", default="flatcake")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="bench_out/replay_cells")
    parser.add_argument("--saved", default="bench_out/replay", help="the sweep's --out")
    parser.add_argument("--table", action="store_true", help="print the goal table and stop")
    args = parser.parse_args()
    out = Path(args.out)
    if args.table:
        print(table(out, Path(args.saved)))
        return 0
    tasks: list[tuple[Any, ...]] = []
    for item in filter(None, args.runs.split(",")):
        cell, load = item.split(":")
        for system in args.systems.split(","):
            tasks += [(cell, system, float(load), int(s), out) for s in args.seeds.split(",")]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for future in as_completed([pool.submit(run_cell, *task) for task in tasks]):
            print(future.result(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
