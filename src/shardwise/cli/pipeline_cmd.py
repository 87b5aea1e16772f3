"""``shardwise pipeline simulate``: a pipeline schedule's timeline, bubble and memory."""

from __future__ import annotations

import argparse
from fractions import Fraction
from pathlib import Path

from shardwise.parallel.layout import (
    MAX_MICROBATCHES,
    MAX_STAGES,
    SIMULATE_FLAGS,
    Layout,
    check_layout,
)
from shardwise.parallel.pipeline.simulate import MAX_STAGE_MICROBATCHES


def _time(text: str) -> Fraction:
    try:
        value = Fraction(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"times must be >= 0, got {text}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pipeline",
        help="pipeline schedules: simulate one step",
        description="Pipeline-parallel schedules as data.",
    )
    psub = p.add_subparsers(dest="pipeline_command", required=True)
    sim = psub.add_parser(
        "simulate",
        help="simulate one step of a schedule",
        description="Run a schedule's action lists on a model of the machine: per-rank "
        "timeline, bubble fraction, peak in-flight activations; fails naming the ranks if the "
        "schedule deadlocks. Times are per micro-batch per stage (per chunk when interleaved). "
        f"Bounds: stages x virtual stages x micro-batches at most {MAX_STAGE_MICROBATCHES:,}, "
        f"at most {MAX_STAGES:,} stages and {MAX_MICROBATCHES:,} micro-batches.",
    )
    from shardwise.parallel.pipeline.schedule import SCHEDULES

    sim.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    sim.add_argument("--stages", type=int, required=True, help="pipeline ranks (pp)")
    sim.add_argument("--microbatches", type=int, required=True)
    sim.add_argument("--virtual-stages", type=int, default=1, help="chunks per rank (interleaved)")
    sim.add_argument("--t-fwd", type=_time, default=Fraction(1), help="forward time")
    sim.add_argument("--t-bwd", type=_time, default=Fraction(1), help="input-gradient time")
    sim.add_argument("--t-wgrad", type=_time, default=Fraction(1), help="weight-gradient time")
    sim.add_argument("--t-p2p", type=_time, default=Fraction(0), help="one message's time")
    sim.add_argument("--png", type=Path, help="also write a Gantt chart to this .png file")
    sim.set_defaults(func=run_simulate)


def _check_png(path: Path | None) -> None:
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"--png {path} is a directory: name a file in it, e.g. {path / 'pp.png'}")
    if path.suffix.lower() != ".png":
        raise ValueError(f"--png {path}: name a file ending in .png, e.g. {path}.png")


def run_simulate(args: argparse.Namespace) -> int:
    from shardwise.parallel.pipeline.simulate import simulate
    from shardwise.parallel.pipeline.timeline import summary, text_timeline, write_png

    layout = Layout(
        world_size=args.stages,
        pp=args.stages,
        schedule=args.schedule,
        microbatches=args.microbatches,
        virtual_stages=args.virtual_stages,
    )
    check_layout(layout, flags=SIMULATE_FLAGS, single_stage_ok=True)
    _check_png(args.png)
    if args.t_fwd + args.t_bwd + args.t_wgrad == 0:
        raise ValueError("--t-fwd, --t-bwd and --t-wgrad are all 0: give one a time > 0")
    res = simulate(
        args.schedule,
        args.stages,
        args.microbatches,
        virtual_stages=args.virtual_stages,
        t_fwd=args.t_fwd,
        t_bwd=args.t_bwd,
        t_wgrad=args.t_wgrad,
        t_p2p=args.t_p2p,
    )
    for line in [*text_timeline(res), *summary(res)]:
        print(line)
    if args.png:
        print(write_png(res, args.png))
    return 0
