"""``shardwise plan``: rank the parallel plans that fit, by predicted throughput.

shardwise plan --model 7b --devices 64 --hardware h100x8-ib
shardwise plan --model medium --hardware h100x8-ib --scaling 1,2,4,8,16,32,64
"""

from __future__ import annotations

import argparse

from shardwise.cli import plan_measure
from shardwise.cli.estimate_cmd import parse_count
from shardwise.costmodel import Hardware, ModelShape, hardware, shape
from shardwise.costmodel.hardware import PRESETS as HARDWARE
from shardwise.costmodel.predict import Prediction
from shardwise.costmodel.search import MAX_GLOBAL_BATCH, MAX_SCALING_POINTS, rank_plans, scaling
from shardwise.parallel.layout import MAX_DEVICES

GiB = float(1 << 30)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="rank parallel plans by predicted throughput (cost model)",
        description="Predict step time (compute, exposed tp, bubble, p2p, exposed dp, optimizer), "
        "memory per device and MFU of every dp x cp x tp x pp plan that fits, fastest first. "
        f"Bounds: at most {MAX_DEVICES:,} devices, a global batch of at most "
        f"{MAX_GLOBAL_BATCH:,} sequences, {MAX_SCALING_POINTS} --scaling points.",
    )
    p.add_argument("--model", required=True, help="e.g. 7b, llama3-8b, gpt-175b, medium")
    p.add_argument(
        "--devices", type=int, default=8, help=f"device count, 1..{MAX_DEVICES:,} (default 8)"
    )
    p.add_argument("--hardware", default="h100x8-ib", help=f"{' | '.join(HARDWARE)}")
    p.add_argument(
        "--global-batch",
        default=None,
        help="sequences per step, a multiple of the data-parallel ranks (default ~4M tokens)",
    )
    p.add_argument("--top", type=int, default=None, help="plans to show, >= 1 (default 10)")
    p.add_argument(
        "--scaling", default=None, help="device counts for weak scaling, e.g. 1,2,4,8,16,64"
    )
    p.add_argument(
        "--sequences-per-device", type=int, default=None, help="with --scaling (default 8)"
    )
    plan_measure.add_measure_args(p)
    p.set_defaults(func=run_plan)


def _row(i: int, pr: Prediction) -> str:
    b, step = pr.breakdown, pr.step_s
    parts = " ".join(f"{k} {v / step:.0%}" for k, v in b.items() if v > 0)
    return (
        f"{i:>3} {pr.plan.describe():<58} {pr.tokens_per_s_per_device:>9,.0f} "
        f"{pr.mfu:>5.1%} {step:>8.3f} {pr.memory['total'] / GiB:>7.1f}  {parts}"
    )


def _only_with_scaling(args: argparse.Namespace) -> None:
    """Flags of one kind of run given to the other are refused, not ignored."""
    if args.scaling is None and args.sequences_per_device is not None:
        raise ValueError("--sequences-per-device sets a weak-scaling curve: add --scaling")
    if args.scaling is not None:
        for flag, value in (("--global-batch", args.global_batch), ("--top", args.top)):
            if value is not None:
                raise ValueError(
                    f"{flag} ranks the plans of one device count; --scaling picks the best "
                    "plan at each count: drop one of them"
                )


def run_plan(args: argparse.Namespace) -> int:
    if args.measure:
        if args.global_batch is not None:
            args.global_batch = parse_count(args.global_batch, "--global-batch", MAX_GLOBAL_BATCH)
        args.top = 5 if args.top is None else args.top
        return plan_measure.run_measured(args)
    if args.run_top:
        raise ValueError("--run-top runs layouts on this machine's ranks: add --measure")
    _only_with_scaling(args)
    model, hw = shape(args.model), hardware(args.hardware)
    if args.scaling is not None:
        return _scaling(args, model, hw)
    batch = (
        max(1, round(4 * 2**20 / model.seq_len))
        if args.global_batch is None
        else parse_count(args.global_batch, "--global-batch", MAX_GLOBAL_BATCH)
    )
    top = 10 if args.top is None else args.top
    ranked = rank_plans(model, args.devices, hw, batch, top)
    print(f"{model.name} ({model.params() / 1e9:.2f}B params, seq {model.seq_len}) on "
          f"{args.devices} x {hw.name}, global batch {batch} sequences")  # fmt: skip
    if not ranked:
        print("no plan fits in memory: add devices or use a larger-memory hardware preset")
        return 1
    print(f"{'#':>3} {'plan':<58} {'tok/s/dev':>9} {'MFU':>5} {'step s':>8} {'GiB':>7}  breakdown")
    for i, pr in enumerate(ranked, 1):
        print(_row(i, pr))
    return 0


def parse_counts(text: str) -> list[int]:
    """``--scaling``'s comma-separated device counts."""
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--scaling takes comma-separated device counts, e.g. 1,2,4,8; got {text!r}"
        ) from None


def _scaling(args: argparse.Namespace, model: ModelShape, hw: Hardware) -> int:
    counts = parse_counts(args.scaling)
    per_device = 8 if args.sequences_per_device is None else args.sequences_per_device
    points = scaling(model, hw, counts, per_device)
    print(f"{model.name} weak scaling on {hw.name}, {per_device} sequences/device")
    print(
        f"{'devices':>7} {'efficiency':>10} {'exposed comm':>12} {'AR busbw GB/s':>13}  best plan"
    )
    for pt in points:
        if pt.best is None:
            print(f"{pt.devices:>7} {'-':>10} {'-':>12} {'-':>13}  no plan fits")
            continue
        print(f"{pt.devices:>7} {pt.efficiency:>10.2f} {pt.exposed_comm:>12.1%} "
              f"{pt.allreduce_busbw / 1e9:>13.1f}  {pt.best.plan.describe()}")  # fmt: skip
    return 0
