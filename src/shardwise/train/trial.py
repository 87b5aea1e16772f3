"""Timing a ``shardwise train`` layout without training it: the run's model, mesh and engine
built as the trainer builds them (``train.parallel``), fed random tokens for a few steps.

``Trial`` is what ``shardwise plan --run-top`` runs for each layout (``python -m
shardwise.train.trial``), what ``--auto`` calibrates compute with (one rank alone), and what
``benchmarks/auto_plan.py`` keeps alive per layout while layouts take turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import shardwise
from shardwise.comm import World, current_world, ops
from shardwise.comm.groups import Group
from shardwise.train.loop import param_groups
from shardwise.train.options import RunConfig
from shardwise.train.parallel import BuiltModel, build_mesh, build_model


class Trial:
    """One rank's engine for ``run`` over ``world`` (collective to build: every rank of the
    world builds its own), stepped on random tokens by ``step``."""

    def __init__(self, run: RunConfig, world: World, group: Group | None = None) -> None:
        self.run, self.world = run, world
        # group: a one-rank group to time the model alone (the run's mesh is then not built)
        mesh: Any = group if group is not None else build_mesh(run, world)
        if group is not None:
            from shardwise.models.gpt import GPT

            torch.manual_seed(run.engine.seed)
            model: torch.nn.Module = GPT(run.model)
            dp_rank, dp_size, pipeline = 0, 1, False
            self.built: BuiltModel | None = None
        else:
            built = build_model(run, mesh)
            model, pipeline = built.module, built.pipeline
            self.built = built  # its batches split as the trainer splits them (cp)
            dp_rank, dp_size = mesh.group("dp").rank, mesh.group("dp").size
        model.to(current_world.device())  # a GPU rank times its GPU
        opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95))
        cfg = run.engine.replace(checkpoint_dir=None, checkpoint_every=0)
        if group is not None:
            self.engine = shardwise.initialize(model, opt, cfg, group=group)
        else:
            self.engine = shardwise.initialize(built.parallelized, opt, cfg)
        self.pipeline = pipeline
        self.gen = torch.Generator().manual_seed(1 + dp_rank + 1000 * dp_size)
        self.rows = run.micro_batch * run.engine.gradient_accumulation_steps

    def step(self) -> float:
        """One optimizer step on fresh random tokens; this rank's seconds."""
        cfg, dev = self.run.model, current_world.device()
        x = torch.randint(0, cfg.vocab_size, (self.rows, cfg.seq_len + 1), generator=self.gen)
        x = x.to(dev)
        t0 = time.perf_counter()
        built = self.built
        if self.pipeline:
            assert built is not None
            self.engine.train_batch(*built.split(x[:, :-1], x[:, 1:]))  # type: ignore[attr-defined]
        else:
            for chunk in x.split(self.run.micro_batch):
                xs, ys = chunk[:, :-1], chunk[:, 1:]
                loss = built.forward_loss(self.engine, xs, ys) if built else self.engine(xs, ys)
                self.engine.backward(loss)
            self.engine.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    def timed(self, steps: int, warmup: int = 1) -> list[float]:
        """``steps`` timed steps after ``warmup`` untimed ones, each the slowest rank's
        seconds (collective over the world)."""
        times = []
        for i in range(warmup + steps):
            ops.barrier(group=self.world.group)
            took = torch.tensor([self.step()], dtype=torch.float64, device=current_world.device())
            ops.all_reduce(took, "max", group=self.world.group)
            if i >= warmup:
                times.append(float(took.item()))
        return times


def main(argv: Sequence[str] | None = None) -> int:
    """A launched rank: time the layout of ``RUN_CONFIG`` (a config.json); rank 0 writes
    ``{"times": [...], "median_s": ...}`` to ``OUT``."""
    p = argparse.ArgumentParser(prog="python -m shardwise.train.trial")
    p.add_argument("run_config", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    run = RunConfig.read(args.run_config)
    world = shardwise.init()
    times = Trial(run, world).timed(args.steps, args.warmup)
    if world.rank == 0:
        out = {"times": times, "median_s": statistics.median(times)}
        args.out.write_text(json.dumps(out) + "\n")
    shardwise.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
