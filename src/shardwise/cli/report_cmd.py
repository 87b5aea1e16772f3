"""``shardwise report RUN_DIR``: plots and an HTML page of a training run."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="plot a training run and write report.html",
        description="Write loss, throughput, memory and communication plots "
        "(PNG) and report.html for a shardwise train run directory.",
    )
    p.add_argument("run_dir", type=Path, help="the run directory (holds config.json)")
    p.add_argument("--out", type=Path, help="output directory (default RUN_DIR/report)")
    p.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    from shardwise.train.report import write_report  # matplotlib loads only for this command

    paths = write_report(args.run_dir, args.out)
    for path in paths:
        print(path)
    return 0
