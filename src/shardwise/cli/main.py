"""Entry point of the ``shardwise`` command."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from shardwise.cli.launch import LaunchError, add_launch_args, launch


def _cmd_run(args: argparse.Namespace) -> int:
    if not args.script:
        raise LaunchError("shardwise run needs a script: shardwise run [options] script.py [args]")
    return launch(args, [args.script, *args.script_args])


def _add_run(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="start a script on N ranks (torch's elastic launcher)")
    add_launch_args(run)
    run.add_argument("script", nargs="?", help="the Python script every rank runs")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    run.set_defaults(func=_cmd_run)


def build_parser() -> argparse.ArgumentParser:
    """``run`` here; every other command is a ``shardwise.cli.*_cmd`` module whose
    ``add_parser(subparsers)`` registers it."""
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description=(
            "Train PyTorch models across ranks with ZeRO sharding, mixed precision and "
            "fault-tolerant checkpoints."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    import shardwise.cli as cli_pkg

    for info in sorted(pkgutil.iter_modules(cli_pkg.__path__), key=lambda m: m.name):
        if info.name.endswith("_cmd"):
            importlib.import_module(f"shardwise.cli.{info.name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"shardwise {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"shardwise {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
