"""The ``flatcake-ray`` command: demo, service (start/status/stop/bench), trace, replay.

Every error prints one line, ``flatcake-ray: error: ...``, on stderr and exits non-zero
(2 for a malformed command line, 1 otherwise, 130 when interrupted); ``--debug`` (before or
after the subcommand) prints the traceback too.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import NoReturn

from flatcake_ray.errors import FlatCakeError

PROG = "flatcake-ray"


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (``--help`` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from flatcake_ray.cli.demo import add_demo_command
    from flatcake_ray.cli.replay import add_replay_commands
    from flatcake_ray.cli.service import add_service_commands
    from flatcake_ray.cli.trace import add_trace_commands

    parser = OneLineParser(prog=PROG, description=__doc__)
    parser.add_argument("--debug", action="store_true", help="print tracebacks of errors")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_demo_command(subparsers)
    add_service_commands(subparsers)
    add_trace_commands(subparsers)
    add_replay_commands(subparsers)
    _add_debug_flags(subparsers)
    return parser


def _add_debug_flags(subparsers: argparse._SubParsersAction) -> None:
    """``--debug`` after any subcommand too (SUPPRESS: an absent one keeps the top's value)."""
    for sub in set(subparsers.choices.values()):
        if "--debug" not in sub._option_string_actions:
            sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                _add_debug_flags(action)


def print_error(message: str) -> None:
    """``flatcake-ray: error: MESSAGE`` on one line of stderr."""
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)


def describe(exc: BaseException) -> str:
    """One line saying what went wrong."""
    if isinstance(exc, FlatCakeError | OSError):
        return " ".join(str(exc).split()) or type(exc).__name__
    # Others (Ray's errors carry whole remote tracebacks): their first line, and where to look.
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}{': ' + first if first else ''} (--debug shows where)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error the parser printed as one line
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print_error(describe(exc))
        return 1


if __name__ == "__main__":
    sys.exit(main())
