"""The sharded optimizer step, shared by the engine and ``zero_wrap``.

Each rank steps only the pieces it owns (ZeRO paper, section 5.1), after unscaling and clipping
by the global gradient norm, then publishes the updated parameters.

A parameter that no rank produced a gradient for since the last step is not updated at all (as in
one process, where its ``.grad`` stays None and the optimizer skips it; as DDP with
``find_unused_parameters=True``): the ranks decide it together with one all_reduce of a
one-byte-per-parameter "used" map. A parameter only some ranks used gets the average over all
ranks, the others contributing zeros, as in DDP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from shardwise.comm import ops
from shardwise.comm.groups import Group
from shardwise.precision import DynamicLossScaler
from shardwise.zero.flat_param import FlatParam


class NormReduction(Protocol):
    """How the gradient norm is summed beyond ZeRO's dp slices (the engine derives it from the
    parameters' placements: ``shardwise.parallel.placement.NormReduction``)."""

    def counts(self, param: torch.Tensor) -> bool: ...

    def reduce(self, sumsq: torch.Tensor, within: Group | None = None) -> None: ...


@dataclass(frozen=True)
class StepResult:
    updated: bool
    grad_norm: float  # before clipping, unscaled; inf on overflow


def _sumsq(g: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(g, dtype=torch.float32).square()


def _local_sumsq(f: FlatParam, g: torch.Tensor, norm: NormReduction | None) -> torch.Tensor:
    """This rank's squares of ``f``'s optimizer-range gradient ``g``, leaving out parameters
    that another rank of a replicating group counts (see ``NormReduction``)."""
    if norm is None or all(norm.counts(p) for p in f.params):
        return _sumsq(g)  # a norm per buffer: no temporary copy of the squares
    total = torch.zeros((), dtype=torch.float32, device=g.device)
    for pc in f.opt_pieces:
        if norm.counts(f.params[f.slots.index(pc.slot)]):
            total += _sumsq(g[pc.shard_start : pc.shard_start + pc.numel])
    return total


def by_group(flats: list[FlatParam]) -> list[list[int]]:
    """Indices of ``flats`` per data-parallel group (``FlatParam.group``), groups in order of
    first appearance: the same order on every rank, so their collectives match."""
    parts: dict[tuple[int, ...], list[int]] = {}
    for i, f in enumerate(flats):
        parts.setdefault(f.group.ranks, []).append(i)
    return list(parts.values())


def global_sumsq(
    flats: list[FlatParam], grads: list[torch.Tensor], norm: NormReduction | None = None
) -> float:
    """Sum of squares of every reduced gradient, each parameter counted once, summed per
    data-parallel group (``by_group``). Communicates, per group: ``norm``'s all_reduces (one
    fp32 value per group splitting some parameter, those inside the dp group left out), then
    (optimizer sharded) one all_reduce of one fp32 value over the shard group (each replica
    holds the same reduced shards, so the replicate group is left out: nothing counted twice);
    with replicated optimizer states every dp rank already has it."""
    total = 0.0
    for part in by_group(flats):
        local = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
        for i in part:
            local += _local_sumsq(flats[i], grads[i], norm)
        f = flats[part[0]]
        t = local.to(f.device).reshape(1)
        if norm is not None:
            norm.reduce(t, within=f.group)
        if f.stage.shard_optimizer:
            ops.all_reduce(t, op="sum", group=f.group)
        total += float(t[0])
    return total


def used_anywhere(flats: list[FlatParam]) -> list[list[bool]]:
    """Per flat buffer, per parameter: did any rank produce a gradient for it since the last
    step. At stage 3 it also checks that every rank gathered the same buffers (``GatherLog``).
    Communicates, per data-parallel group (``by_group``): one all_reduce (max) of one byte per
    parameter (plus 16 at stage 3, first group) per reduce group
    (``FlatParam.reduce_groups``)."""
    out: list[list[bool]] = [[] for _ in flats]
    log = flats[0].log if flats else None
    for n, part in enumerate(by_group(flats)):
        bits = [u for i in part for u in flats[i].used]
        lanes = log.lanes() if log is not None and n == 0 else []
        t = torch.tensor(bits + lanes, dtype=torch.uint8, device=flats[part[0]].device)
        for g in flats[part[0]].reduce_groups():
            ops.all_reduce(t, op="max", group=g)
        values = t.tolist()
        if lanes:
            assert log is not None
            try:
                log.check(values[len(bits) :])
            finally:
                log.reset()
        start = 0
        for i in part:
            out[i] = [bool(b) for b in values[start : start + len(flats[i].used)]]
            start += len(flats[i].used)
    return out


def overflow_anywhere(grads: list[torch.Tensor], group: Group) -> bool:
    """Whether any rank of ``group`` holds a non-finite value in its ``grads`` (every rank
    gets the same answer). Communicates: one all_reduce (max) of one fp32 value over
    ``group``."""
    bad = any(not bool(torch.isfinite(g).all()) for g in grads)
    device = grads[0].device if grads else torch.device("cpu")
    flag = torch.tensor([1.0 if bad else 0.0], dtype=torch.float32, device=device)
    ops.all_reduce(flag, op="max", group=group)
    return bool(flag[0] > 0)


def sharded_step(
    flats: list[FlatParam],
    optimizer: torch.optim.Optimizer,
    scaler: DynamicLossScaler,
    clip: float | None,
    norm: NormReduction | None = None,
    overflow_group: Group | None = None,
) -> StepResult:
    """Unscale, clip, step and publish. A non-finite gradient (inf/nan anywhere, on any rank)
    skips the step on every rank (and, with loss scaling, lowers the scale); ``grad_norm`` then
    says inf or nan. ``norm``: how the norm sums over groups other than dp (None: dp only).
    ``overflow_group``: with loss scaling, the group whose ranks must skip or step together
    (a pipeline's whole mesh): the overflow decision is one all_reduce over it, whatever
    parts of the gradients the norm leaves out on some rank."""
    trainable = [f for f in flats if f.trainable]
    used = used_anywhere(trainable)
    grads = [f.optimizer_grad() for f in trainable]
    scale = scaler.scale
    sumsq = global_sumsq(trainable, grads, norm)
    found_inf = not math.isfinite(sumsq)
    if overflow_group is not None and scaler.enabled:
        found_inf = overflow_anywhere(grads, overflow_group) or found_inf
    if scaler.update(found_inf) or found_inf:
        return StepResult(False, float("nan") if math.isnan(sumsq) else float("inf"))
    grad_norm = math.sqrt(sumsq) / scale
    coef = 1.0 / scale
    if clip is not None:
        coef *= min(1.0, clip / (grad_norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
    for f, g, flags in zip(trainable, grads, used):
        if coef != 1.0:
            g.mul_(coef)
        index = {slot.name: j for j, slot in enumerate(f.slots)}
        for pc, op in zip(f.opt_pieces, f.opt_params):
            # no gradient anywhere: None, so the optimizer leaves it and its states alone
            used_here = flags[index[pc.slot.name]]
            op.grad = g[pc.shard_start : pc.shard_start + pc.numel] if used_here else None
    optimizer.step()
    handles = [f.publish_master() for f in trainable]
    for h in handles:
        if h is not None:
            h.wait()
    return StepResult(True, grad_norm)


def zero_grads(flats: list[FlatParam]) -> None:
    """Drop accumulated gradients; kept full-gradient buffers (stages 0-1) are zeroed in place
    and re-attached to the parameters."""
    for f in flats:
        f.grad_shard = f.grad_host = None
        f.used = [False] * len(f.used)
        for op in f.opt_params:
            op.grad = None
        if f.stage.shard_grads or f.grad_full is None:
            f.grad_full = None
            continue
        f.grad_full.zero_()
        for slot, p in zip(f.slots, f.params):  # re-attach, in case someone dropped them
            p.grad = f.grad_full[slot.offset : slot.end].view(slot.shape)
