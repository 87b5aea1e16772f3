"""``shardwise train``: check the options, write the run's config.json, start the ranks.

Every option is validated here, in the launcher, before a rank starts: a bad one is a single
error line and exit code 2. The ranks run ``python -m shardwise.train.worker RUN_DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.cli import train_auto, train_outcome
from shardwise.cli import train_preflight as preflight
from shardwise.cli.launch import DEFAULT_GRACE_S, check_launch_args, launch
from shardwise.cli.run_agent import STOPPED_CODES
from shardwise.cli.run_args import DEFAULT_CHECKPOINT_EVERY, DEFAULT_MICRO_BATCH, add_run_args
from shardwise.config import COUNT_MAX, PIPELINE_SCHEDULES, PRECISIONS, Config
from shardwise.train.lock import RunDirLock
from shardwise.train.metrics import read_metrics
from shardwise.train.options import DEFAULT_STEPS, RunConfig, TrainOptions
from shardwise.train.rundir import CHECKPOINTS_NAME, RunDir, latest_run_dir, new_run_dir

DEFAULT_NPROC = 2
DEFAULT_CLIPPING = 1.0

# TrainOptions fields a resumed run may change; everything else shapes the run and must stay.
RESUMABLE = ("steps", "eval_every", "eval_batches", "log_every")
TRAIN_FLAGS = (
    "model",
    "steps",
    "seq_len",
    "lr",
    "warmup_steps",
    "eval_every",
    "eval_batches",
    "log_every",
    "data",
    "max_bytes",
    "tp",
    "sequence_parallel",
    "pp",
    "cp",
    "cp_method",
    "dp_replicate",
)
ENGINE_FLAGS = {
    "zero": "zero_stage",
    "precision": "precision",
    "micro_batch": "micro_batch_size",
    "grad_accum": "gradient_accumulation_steps",
    "seed": "seed",
    "schedule": "pipeline_schedule",
    "microbatches": "pipeline_microbatches",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a GPT on a byte-level text corpus across ranks",
        description="Train a GPT on a byte-level corpus (default: the Python standard library's "
        "sources) on N ranks with ZeRO. Writes config.json, metrics.jsonl, "
        "checkpoints and summary.json into the run directory.",
    )
    groups = add_run_args(
        p, default_nproc=DEFAULT_NPROC, default_steps=DEFAULT_STEPS, default_lr=3e-3
    )
    p.set_defaults(func=run_train)
    t = groups.training
    t.add_argument(
        "--model", help="model preset: tiny | small | medium | anchor | gpt2 (default small)"
    )
    t.add_argument("--data", help="text file or directory (default: the Python stdlib)")
    t.add_argument("--max-bytes", type=int, help="read at most this many corpus bytes")
    par = groups.parallel
    par.add_argument(
        "--sequence-parallel",
        action="store_true",
        default=None,
        help="with --tp: run norms and dropout on 1/tp of the sequence",
    )
    par.add_argument(
        "--pp",
        type=int,
        help="pipeline-parallel degree: stages the layers are split into (default 1)",
    )
    par.add_argument(
        "--cp",
        type=int,
        help="context-parallel degree: ranks splitting each sequence, attention exact over "
        "them (default 1)",
    )
    par.add_argument(
        "--cp-method",
        help="with --cp: ring | all_to_all (default ring; all_to_all splits the heads per tp "
        "rank over cp)",
    )
    par.add_argument(
        "--schedule",
        help=f"with --pp: {' | '.join(PIPELINE_SCHEDULES)} (default 1f1b)",
    )
    par.add_argument(
        "--microbatches",
        type=int,
        help="with --pp: pipeline micro-batches each --micro-batch is split into (default: pp)",
    )
    train_auto.add_auto_args(p)


def _given(args: argparse.Namespace, names: tuple[str, ...] | list[str]) -> dict[str, Any]:
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _check_engine_flags(args: argparse.Namespace) -> None:
    if args.zero is not None and args.zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be one of 0, 1, 2, 3, got {args.zero}")
    if args.precision is not None and args.precision not in PRECISIONS:
        raise ValueError(
            f"--precision must be one of {', '.join(PRECISIONS)}, got {args.precision!r}"
        )
    if args.schedule is not None and args.schedule not in PIPELINE_SCHEDULES:
        raise ValueError(
            f"--schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {args.schedule!r}"
        )
    for flag in ("micro_batch", "grad_accum", "microbatches"):
        value = getattr(args, flag)
        if value is not None and not 1 <= value <= COUNT_MAX:
            bound = ">= 1" if value < 1 else f"<= {COUNT_MAX}"
            raise ValueError(f"--{flag.replace('_', '-')} must be {bound}, got {value}")
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")


def _engine_config(args: argparse.Namespace, run_dir: RunDir) -> Config:
    """File values over the train defaults, flags over both."""
    base = Config.from_file(args.config) if args.config else Config()
    defaults = Config().to_dict()
    from_file = {k for k, v in base.to_dict().items() if v != defaults[k]}
    values = base.to_dict()
    if "micro_batch_size" not in from_file:
        values["micro_batch_size"] = DEFAULT_MICRO_BATCH
    if "gradient_clipping" not in from_file:
        values["gradient_clipping"] = DEFAULT_CLIPPING
    if "checkpoint_every" not in from_file:
        values["checkpoint_every"] = DEFAULT_CHECKPOINT_EVERY
    flags = {ENGINE_FLAGS[k]: v for k, v in _given(args, list(ENGINE_FLAGS)).items()}
    if args.checkpoint_every is not None:
        flags["checkpoint_every"] = args.checkpoint_every
    values.update(flags)
    if args.activation_checkpointing:
        values["activation_checkpointing"] = ["Block"]
    if args.pp is not None and args.pp > 1:
        _pipeline_defaults(args.pp, values, from_file | set(flags))
    values["checkpoint_dir"] = CHECKPOINTS_NAME  # relative to the run dir: it may move
    values["resume"] = "never"  # the worker resumes explicitly (--resume), with the sampler
    return Config.from_dict(values)


def _pipeline_defaults(pp: int, values: dict[str, Any], chosen: set[str]) -> None:
    """A pipeline run's defaults for what neither the file nor a flag set: pp micro-batches,
    two stages per rank under interleaved_1f1b."""
    if "pipeline_microbatches" not in chosen:
        values["pipeline_microbatches"] = pp
    if "pipeline_virtual_stages" not in chosen:
        interleaved = values["pipeline_schedule"] == "interleaved_1f1b"
        values["pipeline_virtual_stages"] = 2 if interleaved else 1


def _new_run(args: argparse.Namespace) -> tuple[RunConfig, RunDir]:
    run_dir = RunDir(args.run_dir) if args.run_dir else new_run_dir()
    if run_dir.exists():
        raise ValueError(
            f"{run_dir.root} already holds a run: pass --resume to continue it, "
            "or choose another --run-dir"
        )
    args.nproc_per_node = DEFAULT_NPROC if args.nproc_per_node is None else args.nproc_per_node
    check_launch_args(args)
    if args.data is not None and Path(args.data).exists():
        args.data = str(Path(args.data).resolve())  # ranks and resumes may run elsewhere
    opts = TrainOptions(**_given(args, TRAIN_FLAGS))
    run = RunConfig(
        train=opts,
        engine=_engine_config(args, run_dir),
        world_size=args.nproc_per_node * args.nnodes,
        launch={"nproc_per_node": args.nproc_per_node, "nnodes": args.nnodes},
    )
    return run, run_dir


def _changed_on_resume(args: argparse.Namespace, run: RunConfig) -> list[str]:
    """Flags given with --resume whose value differs from the run's (except RESUMABLE)."""
    saved: dict[str, Any] = {f: getattr(run.train, f) for f in TRAIN_FLAGS}
    saved.update({flag: getattr(run.engine, key) for flag, key in ENGINE_FLAGS.items()})
    saved["activation_checkpointing"] = bool(run.engine.activation_checkpointing) or None
    saved["config"] = None
    return [
        f
        for f, v in saved.items()
        if f not in RESUMABLE and getattr(args, f, None) not in (None, v)
    ]


def _resumed_run(args: argparse.Namespace) -> tuple[RunConfig, RunDir]:
    run_dir = (RunDir(args.run_dir) if args.run_dir else latest_run_dir()).require()
    run = RunConfig.read(run_dir.config)
    changed = _changed_on_resume(args, run)
    if changed:
        allowed = ", ".join("--" + f.replace("_", "-") for f in (*RESUMABLE, "checkpoint_every"))
        raise ValueError(
            f"--{changed[0].replace('_', '-')} cannot change when resuming: the "
            f"run keeps its model, data and batch shape; only {allowed} may"
        )
    saved_nproc = run.launch.get("nproc_per_node", run.world_size)
    args.nproc_per_node = saved_nproc if args.nproc_per_node is None else args.nproc_per_node
    check_launch_args(args)
    if args.nproc_per_node * args.nnodes != run.world_size:
        raise ValueError(
            f"the run was trained on {run.world_size} ranks: resume it with "
            f"--nproc-per-node {saved_nproc}"
        )
    opts = dataclasses.replace(run.train, **_given(args, RESUMABLE))
    engine = run.engine.replace(checkpoint_dir=CHECKPOINTS_NAME)  # a moved run keeps its own
    if args.checkpoint_every is not None:
        engine = engine.replace(checkpoint_every=args.checkpoint_every)
    resumed = RunConfig(
        train=opts,
        engine=engine,
        world_size=run.world_size,
        launch=run.launch,
        finetune=run.finetune,
    )
    return resumed, run_dir


def _slowest_step_s(run_dir: RunDir) -> float:
    if not run_dir.metrics.is_file():
        return 0.0
    return max((r.get("step_time_s") or 0.0 for r in read_metrics(run_dir.metrics)), default=0.0)


def _grace(args: argparse.Namespace, run_dir: RunDir) -> Callable[[], float]:
    """The grace period when a stop signal arrives: the flag, else a step and a save's worth."""

    def grace_s() -> float:
        if args.grace_period_s is not None:
            return float(args.grace_period_s)
        return DEFAULT_GRACE_S + 2 * _slowest_step_s(run_dir)

    return grace_s


def run_train(args: argparse.Namespace) -> int:
    _check_engine_flags(args)
    if args.auto and args.resume:
        raise ValueError("--auto chooses a new run's layout: a resumed run keeps its own")
    run, run_dir = _resumed_run(args) if args.resume else _new_run(args)
    plan = None
    if args.auto:
        run, plan = train_auto.plan_run(args, run)
    if not args.resume:
        preflight.check_layout(run)
        preflight.check_data(run)
        preflight.check_memory(run, args.nproc_per_node)
    headline = (
        f"shardwise train: {run.train.model} model, {run.world_size} ranks ({run.layout()}), "
        f"ZeRO-{run.engine.zero_stage}, {run.engine.precision}, {run.train.steps} steps of "
        f"{run.tokens_per_step} tokens"
    )
    written = None if plan is None else (lambda: train_auto.write_plan(plan, run_dir.root))
    return launch_run(args, run, run_dir, "train", headline, written)


def launch_run(
    args: argparse.Namespace,
    run: RunConfig,
    run_dir: RunDir,
    command: str,
    headline: str,
    also_write: Callable[[], None] | None = None,
) -> int:
    """Start the ranks of a checked run (``train`` or ``finetune``): create and lock the run
    directory, write ``config.json`` (and ``also_write``), print ``headline``, launch the
    workers, report how the run ended. Returns the exit code."""
    preflight.open_run_dir(run_dir)
    lock = RunDirLock(run_dir.root) if args.node_rank == 0 else None
    try:
        if lock is not None:
            _lock(lock)
        if not args.resume and run_dir.exists():  # another job started it meanwhile
            raise ValueError(f"{run_dir.root} already holds a run: pass --resume to continue it")
        preflight.write_config(run, run_dir)
        if also_write is not None:
            also_write()
        print(f"{headline} -> {run_dir.root}", flush=True)
        if args.nproc_per_node > 1:
            os.environ.setdefault("OMP_NUM_THREADS", "1")
        target = ["-m", "shardwise.train.worker", str(run_dir.root)]
        before, started = train_outcome.newest_checkpoint(run_dir), time.time()
        result = launch(
            args,
            target + (["--resume"] if args.resume else []),
            command,
            grace_s=_grace(args, run_dir),
        )
    finally:
        if lock is not None:
            lock.release()
    train_outcome.report(run_dir, result.code, started)
    code = result.code
    if result.stop_signal is not None or code in STOPPED_CODES:
        code = train_outcome.stop_message(run_dir, result, before)
    if code != 0:
        print(f"continue with: shardwise {command} --run-dir {run_dir.root} --resume")
    return code


def _lock(lock: RunDirLock) -> None:
    try:
        lock.acquire()
    except OSError as exc:
        raise ValueError(f"cannot lock {lock.path}: {exc.strerror}") from exc
