"""``shardwise topology``: where the ranks run and the measured link between every pair.

shardwise topology --nproc-per-node 4 --json topo.json --png topo.png
"""

from __future__ import annotations

import argparse
import os

from shardwise.cli.launch import add_launch_args, check_launch_args, launch
from shardwise.topology.measure import DEFAULT_SIZES


def _sizes(text: str) -> str:
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--sizes {text!r}: comma-separated byte counts") from exc
    if len(set(sizes)) < 2 or any(s < 4 or s % 4 for s in sizes):
        raise argparse.ArgumentTypeError(
            f"--sizes {text!r}: at least two distinct byte counts, each a multiple of 4"
        )
    return text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "topology",
        help="discover nodes, devices and the alpha-beta of every link",
        description="Start the ranks, print the islands (ranks sharing a node / NVLink) and "
        "the latency and bandwidth of every pair of ranks, fitted from ping-pong.",
    )
    add_launch_args(p, default_nproc=2)
    p.add_argument("--json", default=None, help="write the topology as JSON")
    p.add_argument("--png", default=None, help="draw the bandwidth/latency heat map")
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=",".join(map(str, DEFAULT_SIZES)),
        help="ping-pong message sizes in bytes (default 4 KiB .. 16 MiB)",
    )
    p.add_argument("--reps", type=int, default=10, help="round trips per size (default 10)")
    p.set_defaults(func=run_topology)


def run_topology(args: argparse.Namespace) -> int:
    check_launch_args(args)
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    target = ["-m", "shardwise.topology.worker", "--sizes", args.sizes, "--reps", str(args.reps)]
    for flag in ("json", "png"):
        if getattr(args, flag):
            target += [f"--{flag}", os.path.abspath(getattr(args, flag))]
    if args.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    return launch(args, target, command="topology").code
