"""What an unarmed failpoint costs, beside an empty function call, in one run.

.venv/bin/python benchmarks/failpoint_cost.py
"""

from __future__ import annotations

import statistics
import timeit

from flatcake_ray.failpoints import arm, disarm_all, failpoint


def empty(name: str, **context: object) -> None:
    return None


def main(calls: int = 1_000_000, repeats: int = 7) -> None:
    cases = {"empty function": [], "failpoint, none armed": [], "failpoint, another armed": []}
    for _ in range(repeats):
        for label, fn, other in (
            ("empty function", empty, False),
            ("failpoint, none armed", failpoint, False),
            ("failpoint, another armed", failpoint, True),
        ):
            if other:
                arm("some.other.point", raises=ValueError)
            seconds = timeit.timeit('f("manifest.append")', globals={"f": fn}, number=calls)
            cases[label].append(seconds / calls * 1e9)
            disarm_all()
    for label, samples in cases.items():
        print(f"{label}: {statistics.median(samples):.0f} ns/call (median of {repeats})")


if __name__ == "__main__":
    main()
