"""What every rank of ``shardwise train`` runs: ``python -m shardwise.train.worker RUN_DIR``.

The launcher (``shardwise train``) validates the options and writes ``RUN_DIR/config.json``
before starting the ranks; each rank reads it, trains, and exits with the run's exit code
(130 after Ctrl-C, 143 after SIGTERM).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import shardwise
from shardwise import environment
from shardwise.train.loop import Trainer
from shardwise.train.options import RunConfig
from shardwise.train.rundir import RunDir
from shardwise.train.stop import StopRequest


def _setup_logging(rank: int) -> None:
    """Rank 0 logs progress; the others only warnings. Every line names its rank."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank {rank}] %(message)s",
        force=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardwise.train.worker")
    parser.add_argument("run_dir", type=Path, help="run directory holding config.json")
    parser.add_argument("--resume", action="store_true", help="continue from its checkpoints")
    args = parser.parse_args(argv)
    # a restart after a failure (--max-restarts) continues from the newest valid checkpoint
    restarted = (environment.read(environment.RESTART_COUNT_ENV) or 0) > 0
    run_dir = RunDir(args.run_dir).require()
    run = RunConfig.read(run_dir.config)
    # From here on a signal only asks to stop: a Ctrl-C during setup stops after the first step.
    with StopRequest() as stop:
        world = shardwise.init()
        _setup_logging(world.rank)
        kind = Trainer
        if run.finetune is not None:  # transformers and peft only for fine-tuning runs
            from shardwise.train.finetune import FinetuneTrainer

            kind = FinetuneTrainer
        code = kind(run, run_dir, resume=args.resume or restarted, world=world).run(stop)
        # no shutdown after an error: it would wait for ranks that the launcher now stops
        shardwise.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
