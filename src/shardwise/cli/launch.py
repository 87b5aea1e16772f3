"""``shardwise run``: start ranks through PyTorch's elastic launcher (torch.distributed.run).

One machine and many work the same way; restarts after a failure (``--max-restarts``) are the
elastic launcher's job.
"""

from __future__ import annotations

import argparse
import socket


class LaunchError(ValueError):
    """Bad launcher options."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        help="HOST:PORT of the rendezvous (multi-node; default: a free local port)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart all ranks up to K times after a failure (default 0)",
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
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise LaunchError("--rdzv-endpoint HOST:PORT is required when --nnodes > 1")


def torchrun_argv(args: argparse.Namespace, target: list[str]) -> list[str]:
    """The torch.distributed.run command line for these options; ``target`` is the script (or
    ``-m module``) and its arguments."""
    check_launch_args(args)
    argv = [
        f"--nproc-per-node={args.nproc_per_node}",
        f"--nnodes={args.nnodes}",
        f"--max-restarts={args.max_restarts}",
    ]
    if args.nnodes == 1 and not args.rdzv_endpoint:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    else:
        argv += [
            f"--node-rank={args.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
        ]
    return argv + target


def launch(args: argparse.Namespace, target: list[str]) -> int:
    """Run the elastic launcher in this process; returns its exit code."""
    import os

    from torch.distributed import run as torch_run

    argv = torchrun_argv(args, target)
    if args.max_restarts > 0:
        # restarted ranks must not reuse the first attempt's rendezvous store address, which
        # belonged to a rank that is gone
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    parsed = torch_run.parse_args(argv)
    try:
        torch_run.run(parsed)
    except Exception as exc:  # ChildFailedError: the launcher already printed each rank's error
        name = type(exc).__name__
        if name == "ChildFailedError":
            return 1
        raise
    return 0
