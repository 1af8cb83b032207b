"""The ``flatcake-ray`` command: demo, service (start/status/stop/bench), trace, replay."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from flatcake_ray.cli.demo import add_demo_command
    from flatcake_ray.cli.replay import add_replay_commands
    from flatcake_ray.cli.service import add_service_commands
    from flatcake_ray.cli.trace import add_trace_commands

    parser = argparse.ArgumentParser(prog="flatcake-ray", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_demo_command(subparsers)
    add_service_commands(subparsers)
    add_trace_commands(subparsers)
    add_replay_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
