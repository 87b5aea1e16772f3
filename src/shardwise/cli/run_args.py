"""The options ``shardwise train`` and ``shardwise finetune`` share, built in one place: the
launcher's, the engine's, the training loop's common knobs, tensor / hierarchical data
parallelism and the run directory. Each command adds its own to the groups returned."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from shardwise.cli.launch import add_launch_args
from shardwise.config import PRECISIONS

DEFAULT_MICRO_BATCH = 8
DEFAULT_CHECKPOINT_EVERY = 100


@dataclass(frozen=True)
class RunGroups:
    """The argument groups a command adds its own options to."""

    engine: argparse._ArgumentGroup
    training: argparse._ArgumentGroup
    parallel: argparse._ArgumentGroup
    run_dir: argparse._ArgumentGroup


def add_run_args(
    p: argparse.ArgumentParser, *, default_nproc: int, default_steps: int, default_lr: float
) -> RunGroups:
    """Add the shared options to ``p`` (``nproc_per_node`` defaults to None: decided after
    parsing, from a resumed run's config or ``default_nproc``)."""
    add_launch_args(p, default_nproc=default_nproc)
    p.set_defaults(nproc_per_node=None)
    g = p.add_argument_group("engine")
    g.add_argument("--zero", type=int, help="ZeRO stage 0-3 (default 0)")
    g.add_argument("--precision", help=f"{' | '.join(PRECISIONS)} (default fp32)")
    g.add_argument(
        "--micro-batch",
        type=int,
        help=f"sequences per rank per micro-step (default {DEFAULT_MICRO_BATCH})",
    )
    g.add_argument("--grad-accum", type=int, help="micro-steps per optimizer step (default 1)")
    g.add_argument(
        "--activation-checkpointing",
        action="store_true",
        default=None,
        help="recompute each transformer block's activations in backward",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        help=f"save a checkpoint every N steps (default {DEFAULT_CHECKPOINT_EVERY}; "
        "0: only at the end)",
    )
    g.add_argument("--seed", type=int, help="seed of weights and data order (default 0)")
    g.add_argument(
        "--config", type=Path, help="a shardwise Config file (.toml/.json/.yaml); flags override it"
    )
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, help=f"optimizer steps (default {default_steps})")
    t.add_argument("--lr", type=float, help=f"peak learning rate, AdamW (default {default_lr:g})")
    t.add_argument("--warmup-steps", type=int, help="linear warmup (default 10%% of steps)")
    t.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    t.add_argument("--eval-every", type=int, help="validation every N steps (default 50)")
    t.add_argument("--eval-batches", type=int, help="validation micro-batches per rank")
    t.add_argument("--log-every", type=int, help="steps between log lines off a terminal")
    par = p.add_argument_group("model parallelism")
    par.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel degree: ranks splitting each layer; the rest are data parallel "
        "(default 1)",
    )
    par.add_argument(
        "--dp-replicate",
        type=int,
        help="hierarchical sharding (HSDP): ZeRO shards inside each of this many replicas of "
        "the dp ranks (e.g. one per node) and the replicas all-reduce; default 1 (flat)",
    )
    r = p.add_argument_group("run directory")
    r.add_argument(
        "--run-dir",
        type=Path,
        help="where the run's files go (default runs/<timestamp>; with --resume: the newest)",
    )
    r.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --run-dir from its newest checkpoint",
    )
    return RunGroups(g, t, par, r)
