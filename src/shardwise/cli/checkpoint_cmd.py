"""``shardwise checkpoint``: look at, check and export a checkpoint offline (no ranks needed).

    shardwise checkpoint inspect PATH              # summary, engine settings, verification
    shardwise checkpoint verify PATH               # exit 0 when intact, 1 (one line) when not
    shardwise checkpoint export PATH OUT.safetensors

PATH is a checkpoint root (its latest committed step) or a ``step-N`` directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardwise.checkpoint import CheckpointError, inspect, verify_cli
from shardwise.engine_weights import describe, export_model_state


def _inspect(args: argparse.Namespace) -> int:
    print(inspect(args.path))
    print(describe(args.path))
    return 0


def _verify(args: argparse.Namespace) -> int:
    ok, message = verify_cli(args.path)
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def _export(args: argparse.Namespace) -> int:
    try:
        names = export_model_state(args.path, args.out)
    except CheckpointError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"exported {len(names)} tensors (fp32 model state, tied aliases included) to {args.out}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``shardwise checkpoint inspect | verify | export``."""
    p = sub.add_parser(
        "checkpoint",
        help="inspect, verify or export a sharded checkpoint",
        description="Offline tools for sharded checkpoints. PATH is a "
        "checkpoint root (its latest committed step) or a step-N "
        "directory.",
    )
    cmds = p.add_subparsers(dest="checkpoint_command", required=True)
    c = cmds.add_parser("inspect", help="summary: tensors, bytes, run settings, verification")
    c.add_argument("path", type=Path)
    c.set_defaults(func=_inspect)
    c = cmds.add_parser("verify", help="check every file's sha256; exit code 1 when damaged")
    c.add_argument("path", type=Path)
    c.set_defaults(func=_verify)
    c = cmds.add_parser(
        "export",
        help="write the full fp32 model state to one safetensors "
        "file that loads into the plain model",
    )
    c.add_argument("path", type=Path)
    c.add_argument("out", type=Path, help="output file, e.g. model.safetensors")
    c.set_defaults(func=_export)
