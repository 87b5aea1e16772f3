"""``--auto`` for the commands that train (``train``, ``finetune``): measure the ranks, search
every layout, print the best five, and hand back the run of the best one (``plan_run``).

The ranks are measured by ``python -m shardwise.train.calibrate_worker`` started with the
command's own launcher options (so on the ranks and devices that will train), within
``--auto-budget-s``; the search is ``train.layout_choice.choose``. Flags the user gave pin their
dimensions. When no layout fits, one line says the least memory any needs and on how many ranks
one would fit, before anything is measured. What is searched is the command's
``layout_choice.Target``: the built-in GPT for ``train``, the Hugging Face model for
``finetune``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from shardwise.bytesize import format_bytes
from shardwise.cli import train_preflight as preflight
from shardwise.cli.launch import launch
from shardwise.comm.allreduce_rounds import LinkCost
from shardwise.costmodel.calibrate_ranks import Calibration
from shardwise.costmodel.hardware import measured
from shardwise.costmodel.layout_search import (
    Ranked,
    layout_record,
    prediction_record,
    ranks_to_fit,
)
from shardwise.train import layout_choice
from shardwise.train.options import RunConfig
from shardwise.train.plan_check import PLAN_NAME

DEFAULT_BUDGET_S = 60.0
TOP = 5
CHECKS: list[layout_choice.Check] = [
    preflight.check_layout,
    lambda run: preflight.check_memory(run, run.launch.get("nproc_per_node", run.world_size)),
]


def add_auto_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("automatic layout")
    g.add_argument(
        "--auto",
        action="store_true",
        help="measure the ranks, search every layout that fits (mesh, ZeRO, recompute, "
        "micro-batches, schedule, all-reduce algorithm), print the best five and run the "
        "best; flags given pin their dimensions",
    )
    g.add_argument(
        "--auto-budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds the calibration may take (default {DEFAULT_BUDGET_S:g})",
    )
    g.add_argument(
        "--global-batch",
        type=int,
        help="with --auto: sequences per optimizer step (default: what the flags give, "
        "--micro-batch x --grad-accum x data-parallel ranks)",
    )


def pins(args: argparse.Namespace) -> dict[str, Any]:
    """The pinnable flags the user gave."""
    return {
        k: getattr(args, k)
        for k in layout_choice.PINNABLE
        if getattr(args, k, None) is not None  # finetune has no --cp
    }


def row(i: int, r: Ranked, best_step: float) -> str:
    p = r.prediction
    parts = " ".join(f"{k} {v * 1e3:.0f}ms" for k, v in p.breakdown.items() if v > 5e-4)
    return (f"{i:>2} {r.layout.describe():<64} {p.step_s:>8.3f} {p.step_s / best_step:>6.2f}x "
            f"{format_bytes(p.memory['total']):>10}  {parts}")  # fmt: skip


def _placeholder(memory_bytes: int, devices_per_node: int) -> Any:
    """Hardware for a memory-only search (speeds are not used to decide what fits)."""
    free = LinkCost(0.0, 0.0)
    return measured((free, free), devices_per_node, 1.0, memory_bytes, 1.0)


def _refuse_if_nothing_fits(
    base: RunConfig, target: layout_choice.Target, global_batch: int, nproc: int
) -> None:
    memory, _ = preflight.memory_per_rank(nproc)
    hw = _placeholder(memory, nproc)
    gpu = torch.cuda.is_available()  # offload saves device memory only where it is not the host
    host_bw = 1.0 if gpu else 0.0
    choice = layout_choice.choose(base, hw, global_batch, {}, [], host_bw, target)
    if choice.result.ranked:
        return
    least = choice.result.smallest
    need = "no layout" if least is None else format_bytes(least.prediction.memory["total"])
    space = layout_choice.train_space(base.engine.precision, gpu, lambda _: True, target)
    n = ranks_to_fit(target.shape, hw, space, base.world_size * 2, target.stages)
    where = f"it would fit on {n} such ranks" if n else "no count of such ranks up to 4096 holds it"
    raise ValueError(
        f"--auto: no layout of the {target.shape.name} model (seq {target.shape.seq_len}, global "
        f"batch {global_batch}) fits {base.world_size} ranks of {format_bytes(memory)}: the "
        f"smallest needs {need} per rank ({least.layout.describe() if least else '-'}); {where}"
    )


def calibrate(args: argparse.Namespace, base: RunConfig, command: str = "train") -> Calibration:
    """Launch the calibration on the command's ranks (``base.finetune``: its Hugging Face
    model's step is the compute probe); its JSON back."""
    memory, _ = preflight.memory_per_rank(args.nproc_per_node)
    probe = dataclasses.replace(
        base.train, tp=1, pp=1, cp=1, dp_replicate=1, sequence_parallel=False
    )
    engine = base.engine.replace(micro_batch_size=min(4, base.global_batch_size),
                                 gradient_accumulation_steps=1, zero_stage=0,
                                 pipeline_schedule="1f1b", pipeline_microbatches=1,
                                 pipeline_virtual_stages=1, activation_checkpointing=None,
                                 allreduce_algorithm="native", offload_optimizer=False)  # fmt: skip
    run = RunConfig(train=probe, engine=engine, world_size=base.world_size, launch=base.launch,
                    finetune=base.finetune)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="shardwise-auto-") as tmp:
        config, out = Path(tmp) / "config.json", Path(tmp) / "calibration.json"
        run.write(config)
        target = ["-m", "shardwise.train.calibrate_worker", str(config), str(out),
                  "--budget-s", str(args.auto_budget_s), "--devices-per-node",
                  str(args.nproc_per_node), "--memory-bytes", str(memory)]  # fmt: skip
        if args.nproc_per_node > 1:
            os.environ.setdefault("OMP_NUM_THREADS", "1")
        result = launch(args, target, f"{command} --auto")
        if result.code != 0 or not out.is_file():
            raise ValueError(f"--auto: the calibration ranks failed (exit code {result.code})")
        return Calibration.from_dict(json.loads(out.read_text()))


def plan_record(
    calib: Calibration, choice: layout_choice.Choice, best: Ranked, pinned: dict[str, Any]
) -> dict[str, Any]:
    """What ``plan.json`` keeps: the chosen layout and its prediction, the runners-up, the
    pins, the search's size and the calibration it ran on."""
    return {
        "layout": layout_record(best.layout),
        "settings": layout_choice.train_settings(best.layout),
        "predicted": prediction_record(best.prediction),
        "global_batch": choice.global_batch,
        "pins": pinned,
        "searched": choice.result.searched,
        "fitting": len(choice.result.ranked),
        "top": [
            {"layout": r.layout.describe(), **prediction_record(r.prediction)}
            for r in choice.result.ranked[:TOP]
        ],
        "calibration": calib.to_dict(),
    }


def plan_run(
    args: argparse.Namespace,
    base: RunConfig,
    target: layout_choice.Target | None = None,
    checks: list[layout_choice.Check] | None = None,
    command: str = "train",
) -> tuple[RunConfig, dict[str, Any]]:
    """The run of the best layout of ``target`` (default: ``base``'s built-in GPT) for
    ``base`` (its data, precision and ranks) that passes ``checks`` (default: the train
    command's ``CHECKS``), and the record of the choice; prints the calibration and the best
    five. ``ValueError``: nothing fits (before measuring), or the pins leave nothing."""
    target = target or layout_choice.gpt_target(base)
    checks = CHECKS if checks is None else checks
    if args.auto_budget_s is None or not args.auto_budget_s > 0:
        raise ValueError(f"--auto-budget-s must be > 0 seconds, got {args.auto_budget_s}")
    if args.global_batch is not None and args.global_batch < 1:
        raise ValueError(f"--global-batch must be >= 1, got {args.global_batch}")
    batch = args.global_batch or base.global_batch_size
    _refuse_if_nothing_fits(base, target, batch, args.nproc_per_node)
    calib = calibrate(args, base, command)
    print(f"shardwise {command} --auto: {calib.describe()}", flush=True)
    given = pins(args)
    choice = layout_choice.choose(
        base, calib.hardware, batch, given, checks, calib.host_bw_bytes_per_s, target
    )
    ranked = choice.result.ranked
    if not ranked:
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items())
        raise ValueError(
            f"--auto: no layout fits with {flags or 'these options'} for global batch {batch} "
            f"on {base.world_size} ranks: drop a pinned flag or change --global-batch"
        )
    best_step = ranked[0].prediction.step_s
    shown = min(TOP, len(ranked))
    print(f"searched {choice.result.searched} layouts, {len(ranked)} fit; best {shown} "
          "(predicted step s, vs the best, memory per rank, breakdown):")  # fmt: skip
    for i, r in enumerate(ranked[:TOP], 1):
        print(row(i, r, best_step))
    print(f"running #1: {ranked[0].layout.describe()}", flush=True)
    return layout_choice.run_config(base, ranked[0].layout, target.blocks), plan_record(
        calib, choice, ranked[0], given
    )


def write_plan(record: dict[str, Any], run_dir: Path) -> None:
    """Write the choice's record as ``plan.json`` in the run directory."""
    path = run_dir / PLAN_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
