"""Rank-side bodies of the context-parallel checkpoint tests: the GPT saved at one dp x cp
layout, loaded and continued at another (imported by the spawned ranks)."""

from __future__ import annotations

import cp_cases as cc
import torch

import shardwise

SAVED_AT, STEPS, SEQ = 2, 5, 16  # SEQ divides by 2 x cp for cp up to 4
# no padding: every row counts the same tokens, so one rank's mean over all rows equals the
# mean of dp ranks' means, and every layout runs the same loss
DATA = cc.lm_batches(STEPS, 4, SEQ, pad=False)


def _engine(dp: int, cp: int, stage: int) -> tuple:
    from shardwise.models.gpt import GPT
    from shardwise.parallel.plans import gpt as gpt_plans

    mesh = shardwise.Mesh(dp=dp, cp=cp)
    cfg = cc.gpt_config(SEQ)
    torch.manual_seed(0)
    par = shardwise.parallelize(GPT(cfg), mesh, gpt_plans.plan(cfg, mesh))
    opt = torch.optim.AdamW(par.module.parameters(), lr=1e-3)
    engine = shardwise.initialize(par, opt, shardwise.Config(zero_stage=stage))
    return mesh, par, engine, gpt_plans.loss(cfg, mesh)


def _steps(dp: int, cp: int, stage: int, start: int, stop: int, load: str | None) -> tuple:
    """Losses of steps ``start..stop`` (each the mean over every token of the step's batch) at
    dp x cp and ZeRO ``stage``, from ``load`` when given; the engine."""
    run = _engine(dp, cp, stage)
    if load is not None:
        run[2].load(load)
        assert run[2].global_step == start
    losses = []
    for x, y in DATA[start:stop]:
        losses.extend(_one_step(run, x, y))
    return losses, run


def _one_step(run: tuple, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """One step of ``run`` (mesh, parallelized, engine, loss) on this dp rank's rows of the
    batch; the loss averaged over dp."""
    mesh, par, engine, loss_of = run
    dp, me = mesh.dp_size, mesh.rank("dp")
    xs, ys = x.chunk(dp)[me], y.chunk(dp)[me]
    if par.context is not None:
        xs, ys = par.context.split(xs, ys)
    loss = loss_of(engine(xs), ys)
    engine.backward(loss)
    engine.step()
    total = loss.detach() / dp
    if dp > 1:
        shardwise.comm.all_reduce(total, group=mesh.group("dp"))
    return [float(total)]


def save_and_continue(root: str) -> dict:
    """dp2 x cp2 ZeRO-3: saved after ``SAVED_AT`` steps, then continued to ``STEPS``."""
    losses, run = _steps(2, 2, 3, 0, SAVED_AT, None)
    run[2].save(root)
    after = []
    for x, y in DATA[SAVED_AT:STEPS]:  # the same engine goes on
        after.extend(_one_step(run, x, y))
    return {"before": losses, "after": after, "state": run[2].state_dict()}


def load_and_continue(root: str, dp: int, cp: int, stage: int) -> dict:
    """The checkpoint loaded at dp x cp, ZeRO ``stage``, continued to ``STEPS``."""
    after, run = _steps(dp, cp, stage, SAVED_AT, STEPS, root)
    return {"after": after, "state": run[2].state_dict()}
