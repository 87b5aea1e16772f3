"""Launcher options shared by ``shardwise run`` and ``shardwise train``, and ``launch``.

One machine and many work the same way: each node runs the same command with its
``--node-rank``; node 0 hosts the rendezvous at ``--rdzv-endpoint``. Ranks die with their
launcher, a stop signal gives them ``--grace-period-s`` to finish, and ``--max-restarts``
restarts all of them after a failure (see ``run_agent``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from shardwise.cli.run_agent import LaunchPlan, LaunchResult, run_agent
from shardwise.cli.run_rendezvous import free_port as free_port  # re-exported
from shardwise.cli.run_rendezvous import parse_endpoint
from shardwise.environment import check_environment

DEFAULT_GRACE_S = 60.0
"""Seconds ranks get to stop after Ctrl-C / SIGTERM when no step time is known."""
DEFAULT_RDZV_TIMEOUT_S = 600.0


class LaunchError(ValueError):
    """Bad launcher options."""


def add_launch_args(p: argparse.ArgumentParser, default_nproc: int = 1) -> None:
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=default_nproc,
        help=f"ranks to start on this machine (default {default_nproc})",
    )
    p.add_argument("--nnodes", type=int, default=1, help="number of machines (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index (multi-node)")
    p.add_argument(
        "--rdzv-endpoint",
        default=None,
        help="HOST:PORT where node 0 hosts the rendezvous (multi-node; default: a free local port)",
    )
    p.add_argument(
        "--rdzv-timeout",
        type=float,
        default=DEFAULT_RDZV_TIMEOUT_S,
        help=f"seconds to wait for every node to join (default {DEFAULT_RDZV_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart all ranks up to K times after a failure (default 0)",
    )
    p.add_argument(
        "--grace-period-s",
        type=float,
        default=None,
        help="after Ctrl-C / SIGTERM / SIGHUP, seconds the ranks get to finish before SIGKILL "
        f"(default {DEFAULT_GRACE_S:g}; train: also twice the slowest step so far)",
    )


def check_launch_args(args: argparse.Namespace) -> None:
    if args.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.nnodes < 1:
        raise LaunchError(f"--nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise LaunchError(f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not args.rdzv_timeout > 0:
        raise LaunchError(f"--rdzv-timeout must be > 0 seconds, got {args.rdzv_timeout:g}")
    if args.grace_period_s is not None and not args.grace_period_s >= 0:
        raise LaunchError(f"--grace-period-s must be >= 0 seconds, got {args.grace_period_s:g}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise LaunchError("--rdzv-endpoint HOST:PORT is required when --nnodes > 1")
    if args.rdzv_endpoint:
        parse_endpoint(args.rdzv_endpoint)
    check_environment()  # junk in a SHARDWISE_* variable: one line here, not one per rank


def launch_plan(args: argparse.Namespace, target: list[str]) -> LaunchPlan:
    """The checked plan for these options; ``target`` is ``script.py ARGS`` or ``-m mod ARGS``."""
    check_launch_args(args)
    return LaunchPlan(
        target=list(target),
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        max_restarts=args.max_restarts,
        rdzv_timeout_s=args.rdzv_timeout,
    )


def _say(command: str) -> Callable[[str], None]:
    def say(line: str) -> None:
        print(f"shardwise {command}: {line}", file=sys.stderr, flush=True)

    return say


def launch(
    args: argparse.Namespace,
    target: list[str],
    command: str = "run",
    grace_s: Callable[[], float] | None = None,
) -> LaunchResult:
    """Start ``target`` on this node's ranks and supervise them until they end.

    ``grace_s`` gives the grace period at the moment a stop signal arrives (default: the
    ``--grace-period-s`` flag, else ``DEFAULT_GRACE_S``).
    """
    plan = launch_plan(args, target)
    if grace_s is None:
        flag = args.grace_period_s

        def grace_s() -> float:
            return DEFAULT_GRACE_S if flag is None else float(flag)

    return run_agent(plan, grace_s, _say(command))
