"""``shardwise plan --measure``: the layout search on this machine's measured ranks instead of
a preset, and with ``--run-top K`` each of the best K layouts run for a few steps, predicted
against measured, ranked both ways.

The ranks (``--devices`` of them, on this machine) are measured as ``shardwise train --auto``
measures them; each layout then runs as ``shardwise train`` would build it (``train.trial``),
on random tokens, one launch per layout.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from shardwise.cli import train_auto
from shardwise.cli.launch import DEFAULT_RDZV_TIMEOUT_S, launch
from shardwise.config import Config
from shardwise.costmodel.layout_search import Ranked
from shardwise.costmodel.rank_correlation import rank_correlation
from shardwise.models.gpt import MODEL_SIZES
from shardwise.train import layout_choice
from shardwise.train.options import RunConfig, TrainOptions

DEFAULT_MICRO_BATCH = 8


def add_measure_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--measure",
        action="store_true",
        help="search on this machine's measured ranks (--devices of them) instead of "
        "--hardware; built-in GPT models only",
    )
    p.add_argument(
        "--run-top",
        type=int,
        default=0,
        help="with --measure: run each of the best K layouts for --run-steps steps and print "
        "predicted against measured",
    )
    p.add_argument("--run-steps", type=int, default=3, help="timed steps per layout (default 3)")
    p.add_argument(
        "--auto-budget-s", type=float, default=train_auto.DEFAULT_BUDGET_S,
        help="seconds the calibration may take",
    )  # fmt: skip


def _launch_args(devices: int) -> argparse.Namespace:
    return argparse.Namespace(nproc_per_node=devices, nnodes=1, node_rank=0, rdzv_endpoint=None,
                              max_restarts=0, rdzv_timeout=DEFAULT_RDZV_TIMEOUT_S,
                              grace_period_s=None)  # fmt: skip


def _base(args: argparse.Namespace) -> RunConfig:
    if args.model not in MODEL_SIZES:
        raise ValueError(
            f"--measure runs the model: choose a built-in one ({', '.join(MODEL_SIZES)}), "
            f"not {args.model!r}"
        )
    if args.run_top < 0 or args.run_steps < 1:
        raise ValueError("--run-top must be >= 0 and --run-steps >= 1")
    engine = Config(micro_batch_size=DEFAULT_MICRO_BATCH)
    return RunConfig(train=TrainOptions(model=args.model), engine=engine,
                     world_size=args.devices, launch={"nproc_per_node": args.devices,
                                                      "nnodes": 1})  # fmt: skip


def _run_layout(launch_args: argparse.Namespace, run: RunConfig, steps: int) -> float:
    """Median step seconds of ``run`` on the ranks (one launch of ``train.trial``)."""
    with tempfile.TemporaryDirectory(prefix="shardwise-plan-") as tmp:
        config, out = Path(tmp) / "config.json", Path(tmp) / "times.json"
        run.write(config)
        target = ["-m", "shardwise.train.trial", str(config), str(out), "--steps", str(steps)]
        result = launch(launch_args, target, "plan")
        if result.code != 0 or not out.is_file():
            raise ValueError(f"a layout's run failed (exit code {result.code})")
        return float(json.loads(out.read_text())["median_s"])


def run_measured(args: argparse.Namespace) -> int:
    base = _base(args)
    launch_args = _launch_args(args.devices)
    launch_args.auto_budget_s = args.auto_budget_s
    if args.devices > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    batch = args.global_batch or base.global_batch_size
    calib = train_auto.calibrate(launch_args, base)
    print(
        f"{args.model} on {args.devices} measured ranks, global batch {batch}: {calib.describe()}"
    )
    choice = layout_choice.choose(base, calib.hardware, batch, {}, train_auto.CHECKS,
                                  calib.host_bw_bytes_per_s)  # fmt: skip
    ranked = choice.result.ranked
    if not ranked:
        print("no layout fits in memory: add devices or lower --global-batch")
        return 1
    print(f"searched {choice.result.searched} layouts, {len(ranked)} fit; best {args.top}:")
    for i, r in enumerate(ranked[: args.top], 1):
        print(train_auto.row(i, r, ranked[0].prediction.step_s))
    if args.run_top:
        _run_top(launch_args, base, ranked[: args.run_top], args.run_steps)
    return 0


def _run_top(
    launch_args: argparse.Namespace, base: RunConfig, top: list[Ranked], steps: int
) -> None:
    measured = [_run_layout(launch_args, layout_choice.run_config(base, r.layout), steps)
                for r in top]  # fmt: skip
    by_measured = sorted(range(len(top)), key=lambda i: measured[i])
    print(f"{'pred#':>5} {'meas#':>5} {'layout':<64} {'pred s':>8} {'meas s':>8} {'err':>6}")
    for i, r in enumerate(top):
        err = measured[i] / r.prediction.step_s - 1
        print(f"{i + 1:>5} {by_measured.index(i) + 1:>5} {r.layout.describe():<64} "
              f"{r.prediction.step_s:>8.3f} {measured[i]:>8.3f} {err:>+6.0%}")  # fmt: skip
    best = by_measured[0]
    print(
        f"fastest measured: #{best + 1} by prediction ({top[best].layout.describe()}); "
        f"the predicted best measured {measured[0] / measured[best] - 1:+.0%} slower than it"
    )
    if len(top) > 1:
        rho = rank_correlation([r.prediction.step_s for r in top], measured)
        print(f"rank correlation (Spearman) of predicted and measured step times: {rho:+.2f}")
