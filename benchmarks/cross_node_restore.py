"""Cross-node restore bandwidth per path beside its limit (same as ``flatcake-ray bench restore``).

Run: ``.venv/bin/python benchmarks/cross_node_restore.py [--nodes 2] [--pages 3421]
[--layers 4] [--page-bytes 16KiB] [--repeats 3] [--json] [--address ADDR]``

Without ``--address`` it starts a ``ray.cluster_utils.Cluster`` of ``--nodes`` nodes on
127.0.0.1 and deploys the service on it; see ``flatcake_ray/bench_restore.py`` for what is
measured and how each limit is taken.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from flatcake_ray.cli.bench import add_bench_arguments, run_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
