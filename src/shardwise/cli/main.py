"""Entry point of the ``shardwise`` command."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from pathlib import Path

from shardwise.cli.launch import LaunchError, add_launch_args, launch
from shardwise.cli.run_rendezvous import RendezvousError


def _cmd_run(args: argparse.Namespace) -> int:
    if not args.script:
        raise LaunchError("shardwise run needs a script: shardwise run [options] script.py [args]")
    if args.script != "-m" and not Path(args.script).is_file():
        raise LaunchError(f"script {args.script!r} does not exist")
    result = launch(args, [args.script, *args.script_args])
    if result.killed:
        print(
            "shardwise run: the ranks did not exit within the grace period and were killed "
            "(raise --grace-period-s)",
            file=sys.stderr,
        )
    return result.code


def _add_run(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "run",
        help="start a script on N ranks",
        description="Start a script on N ranks per node. Everything from the script on (or "
        "after --) is the script's own: shardwise run --nproc-per-node 2 script.py --max 3",
        allow_abbrev=False,
    )
    add_launch_args(run)
    run.add_argument("script", nargs="?", help="the Python script every rank runs (or -m MODULE)")
    run.set_defaults(func=_cmd_run, script_args=[])


def split_script_args(
    argv: list[str], parser: argparse.ArgumentParser
) -> tuple[list[str], list[str]]:
    """Split ``run``'s arguments into the launcher's and the script's (from the script on, or
    after ``--``), so that a script's ``--max`` never reaches the launcher's parser."""
    takes_value = {
        opt
        for action in parser._actions
        if action.nargs != 0 and action.option_strings
        for opt in action.option_strings
    }
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i], argv[i + 1 :]
        if not token.startswith("-") or token == "-m":
            return argv[:i], argv[i:]
        i += 2 if token in takes_value else 1
    return argv, []


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
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        launcher_options = argparse.ArgumentParser(add_help=False)
        add_launch_args(launcher_options)
        own, script = split_script_args(argv[1:], launcher_options)
        args = parser.parse_args(["run", *own])
        if script:
            args.script, args.script_args = script[0], script[1:]
    else:
        args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"shardwise {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RendezvousError as exc:
        print(f"shardwise {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"shardwise {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
