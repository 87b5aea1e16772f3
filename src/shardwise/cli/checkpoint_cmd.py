"""``shardwise checkpoint``: look at, check, export and retire checkpoints offline (no ranks).

    shardwise checkpoint inspect PATH              # summary, engine settings, verification
    shardwise checkpoint verify PATH               # exit 0 when intact, 1 (one line) when not
    shardwise checkpoint export PATH OUT.safetensors | OUT_DIR/
    shardwise checkpoint export PATH --hf DIR [--config CONFIG] [--max-shard-size 5GB]
    shardwise checkpoint retire ROOT STEP [--delete]   # set a step aside (or delete it)

PATH is a checkpoint root (its latest committed step) or a ``step-N`` directory. ``inspect``
exits 1 when the checkpoint is missing, unreadable or does not verify.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shardwise.bytesize import parse_bytes
from shardwise.checkpoint import (
    CheckpointError,
    delete_checkpoint,
    inspect,
    set_aside,
    verify_cli,
)
from shardwise.checkpoint.tools import export_consolidated
from shardwise.engine.weights import describe
from shardwise.hf.checkpoint_export import export_checkpoint
from shardwise.hf.errors import WeightsError
from shardwise.hf.model_dir import CONFIG_NAME, GENERATION_CONFIG_NAME


def _inspect(args: argparse.Namespace) -> int:
    text = inspect(args.path)
    print(text)
    ok, _ = verify_cli(args.path)
    if not ok:
        return 1
    print(describe(args.path))
    return 0


def _verify(args: argparse.Namespace) -> int:
    ok, message = verify_cli(args.path)
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def _export_target(out: str) -> Path:
    """The file ``export`` writes: ``out`` itself, or ``out/model.safetensors`` for a directory
    (an existing one, or a name ending in a path separator)."""
    target = Path(out)
    if target.is_dir() or out.endswith(("/", os.sep)):
        target = target / "model.safetensors"
    return target


def _config_files(given: Path | None) -> tuple[Path | None, Path | None]:
    """``--config``: a ``config.json`` file, or a model directory holding it (and maybe a
    ``generation_config.json``)."""
    if given is None or not given.is_dir():
        return given, None
    generation = given / GENERATION_CONFIG_NAME
    return given / CONFIG_NAME, generation if generation.is_file() else None


def _export_hf(args: argparse.Namespace) -> int:
    config, generation = _config_files(args.config)
    for what, p in (("--config", config), ("--tokenizer", args.tokenizer)):
        if p is not None and not p.exists():
            print(f"error: {what} {p} does not exist", file=sys.stderr)
            return 2
    try:
        parse_bytes(args.max_shard_size)
    except ValueError as exc:
        print(f"error: --max-shard-size: {exc}", file=sys.stderr)
        return 2
    try:
        plan = export_checkpoint(
            args.path,
            args.hf,
            args.max_shard_size,
            config=config,
            generation_config=generation,
            tokenizer_dir=args.tokenizer,
        )
    except (CheckpointError, WeightsError, ValueError, OSError) as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    note = "" if config is not None else " (no config.json: give --config for from_pretrained)"
    print(
        f"exported {len(plan.weight_map)} tensors ({plan.total_size} bytes) in "
        f"{len(plan.files)} file(s) to {args.hf}{note}"
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    if (args.out is None) == (args.hf is None):
        print("error: give either OUT (one safetensors file) or --hf DIR", file=sys.stderr)
        return 2
    if args.hf is not None:
        return _export_hf(args)
    target = _export_target(args.out)
    if not target.parent.is_dir():
        print(
            f"error: {target.parent} does not exist; create it or export elsewhere", file=sys.stderr
        )
        return 2
    try:
        names, naming = export_consolidated(args.path, target)
    except (CheckpointError, ValueError) as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(
        f"exported {len(names)} tensors (fp32 model state, tied aliases included) {naming} "
        f"to {target}"
    )
    return 0


def _retire(args: argparse.Namespace) -> int:
    try:
        if args.delete:
            delete_checkpoint(args.root, args.step)
            print(f"deleted step {args.step} of {args.root}")
        else:
            kept = set_aside(args.root, args.step, "retired with shardwise checkpoint retire")
            print(f"set step {args.step} aside as {kept} (no longer a checkpoint)")
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``shardwise checkpoint inspect | verify | export | retire``."""
    p = sub.add_parser(
        "checkpoint",
        help="inspect, verify, export or retire sharded checkpoints",
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
        help="write the full fp32 model state to one safetensors file that loads into the "
        "plain model (a pipeline checkpoint renamed to its names; the output line says which "
        "names it wrote)",
    )
    c.add_argument("path", type=Path)
    c.add_argument(
        "out",
        nargs="?",
        help="output file (e.g. model.safetensors) or a directory to write model.safetensors in",
    )
    c.add_argument(
        "--hf",
        type=Path,
        metavar="DIR",
        help="write a Hugging Face model directory instead (sharded safetensors + index, "
        "tensor by tensor) that transformers' from_pretrained loads",
    )
    c.add_argument(
        "--max-shard-size", default="5GB", help="with --hf: bytes per weights file (5GB)"
    )
    c.add_argument(
        "--config",
        type=Path,
        help="with --hf: the model's config.json (or a model directory holding it) to copy",
    )
    c.add_argument("--tokenizer", type=Path, help="with --hf: a directory of tokenizer files")
    c.set_defaults(func=_export)
    c = cmds.add_parser(
        "retire",
        help="retire a step: renamed to damaged-step-N and kept for inspection (or --delete)",
        description="Retire step STEP of checkpoint root ROOT: the journal records it gone, "
        "then its directory is renamed to damaged-step-N (kept) or, with --delete, removed. "
        "A resumed run then continues from the newest step left and saves STEP again.",
    )
    c.add_argument("root", type=Path, help="checkpoint root (holding journal.log)")
    c.add_argument("step", type=int, help="the step to retire")
    c.add_argument("--delete", action="store_true", help="remove its files instead of keeping")
    c.set_defaults(func=_retire)
