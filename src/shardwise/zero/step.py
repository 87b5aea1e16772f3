"""The sharded optimizer step, shared by the engine and ``zero_wrap``.

Each rank steps only the pieces it owns (ZeRO paper, section 5.1), after unscaling and clipping
by the global gradient norm, then publishes the updated parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardwise import comm
from shardwise.precision import DynamicLossScaler
from shardwise.zero.flat_param import FlatParam


@dataclass(frozen=True)
class StepResult:
    updated: bool
    grad_norm: float  # before clipping, unscaled; inf on overflow


def global_sumsq(flats: list[FlatParam], grads: list[torch.Tensor]) -> float:
    """Sum of squares of every reduced gradient. Communicates (optimizer sharded): one
    all_reduce of one fp32 value; with replicated optimizer states every rank already has it."""
    if not flats:
        return 0.0
    local = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for g in grads:  # a norm per buffer: no temporary copy of the squares
        local += torch.linalg.vector_norm(g, dtype=torch.float32).square()
    f = flats[0]
    if f.stage.shard_optimizer:
        t = local.to(f.device).reshape(1)
        comm.all_reduce(t, op="sum", group=f.group)
        return float(t[0])
    return float(local)


def sharded_step(
    flats: list[FlatParam],
    optimizer: torch.optim.Optimizer,
    scaler: DynamicLossScaler,
    clip: float | None,
) -> StepResult:
    """Unscale, clip, step and publish. An overflow (inf/nan anywhere, on any rank) skips the
    step on every rank and lowers the loss scale."""
    trainable = [f for f in flats if f.trainable]
    grads = [f.optimizer_grad() for f in trainable]
    scale = scaler.scale
    sumsq = global_sumsq(trainable, grads)
    if scaler.update(not math.isfinite(sumsq)):
        return StepResult(False, float("inf"))
    norm = math.sqrt(sumsq) / scale
    coef = 1.0 / scale
    if clip is not None:
        coef *= min(1.0, clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
    for f, g in zip(trainable, grads):
        if coef != 1.0:
            g.mul_(coef)
        for pc, op in zip(f.opt_pieces, f.opt_params):
            op.grad = g[pc.shard_start : pc.shard_start + pc.numel]
    optimizer.step()
    handles = [f.publish_master() for f in trainable]
    for h in handles:
        if h is not None:
            h.wait()
    return StepResult(True, norm)


def zero_grads(flats: list[FlatParam]) -> None:
    """Drop accumulated gradients; kept full-gradient buffers (stages 0-1) are zeroed in place
    and re-attached to the parameters."""
    for f in flats:
        f.grad_shard = f.grad_host = None
        for op in f.opt_params:
            op.grad = None
        if f.stage.shard_grads or f.grad_full is None:
            f.grad_full = None
            continue
        f.grad_full.zero_()
        for slot, p in zip(f.slots, f.params):  # re-attach, in case someone dropped them
            p.grad = f.grad_full[slot.offset : slot.end].view(slot.shape)
