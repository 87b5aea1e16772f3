"""Building an engine's parts and checking what it is given: the model (one device, the same on
every rank), rank 0's state on every rank, the flat buffers, the optimizer over the shards, its
learning-rate scheduler, and the arguments of ``Engine.backward``."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import nn

from shardwise.comm import objects, ops
from shardwise.comm.groups import Group
from shardwise.config import Config
from shardwise.mesh import Axis, Mesh
from shardwise.parallel.placement import ZERO_AXES
from shardwise.zero import optimizer as zero_opt
from shardwise.zero.flat_param import Dtypes, FlatParam
from shardwise.zero.param_schedule import ParamSchedule
from shardwise.zero.stage import ZeroStage
from shardwise.zero.units import buckets, split_by, split_trainable, units

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def resolve_group(group: Group | Mesh) -> Group:
    """The data-parallel group ZeRO shards over: a Mesh's dp axis (its shard groups under
    hierarchical sharding, ``Mesh(dp_replicate=, dp_shard=)``) with its cp axis, or the
    Group. cp ranks hold the same parameters and train on different tokens of the same
    sequences: for ZeRO they are data-parallel ranks (gradients averaged, shards spread)."""
    if isinstance(group, Mesh):
        return group.group(*ZERO_AXES)
    return group


def resolve_replicate(group: Group | Mesh) -> Group | None:
    """The group holding copies of this rank's shards (a Mesh's ``dp_replicate`` part), or
    None when ZeRO shards over the whole dp axis."""
    if isinstance(group, Mesh) and group.dp_replicate_size > 1:
        return group.group(Axis.DP_REPLICATE)
    return None


def resolve_dp(group: Group | Mesh) -> Group:
    """Every data-parallel rank (the shard groups and their replicas together, cp included)."""
    if isinstance(group, Mesh):
        return group.group(Axis.DP, Axis.CP)
    return group


def check_model(model: nn.Module) -> torch.device:
    """The one device of the model's parameters and buffers (meta: every parameter is on the
    meta device; its buffers may be real already, computed before a pipeline split)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    devices = {p.device for p in model.parameters()}
    if devices == {torch.device("meta")}:
        return torch.device("meta")
    devices |= {b.device for b in model.buffers()}
    if not devices:
        raise ValueError("the model has no parameters to train")
    if len(devices) > 1:
        raise ValueError(
            f"the model's parameters and buffers are on different devices "
            f"{sorted(str(d) for d in devices)}; move it to one device first"
        )
    return devices.pop()


def _describe(model: nn.Module) -> list[str]:
    return [f"{n} {list(p.shape)} {p.dtype}" for n, p in model.named_parameters()]


def check_same_structure(model: nn.Module, group: Group, device: torch.device) -> None:
    """Every rank of ``group`` must hold the same parameter names, shapes and dtypes in the same
    order (ranks that build layers in another order would otherwise train silently apart).
    Communicates: one all_gather of 8 bytes per rank; on a mismatch, the descriptions.

    Raises:
        ValueError (on every rank): names the first rank and parameter that differ from the
            group's first rank.
    """
    mine = _describe(model)
    digest = hashlib.sha256("\n".join(mine).encode()).digest()[:8]
    value = torch.tensor([int.from_bytes(digest, "little", signed=True)], device=device)
    if len({int(v) for v in ops.all_gather_list(value, group=group)}) == 1:
        return
    every = objects.all_gather_object(mine, group=group)
    first = every[0]
    for r, other in enumerate(every):
        for i in range(max(len(first), len(other))):
            a = first[i] if i < len(first) else "nothing"
            b = other[i] if i < len(other) else "nothing"
            if a != b:
                raise ValueError(
                    f"ranks build different models: parameter #{i} is {a} on rank "
                    f"{group.ranks[0]} but {b} on rank {group.ranks[r]}; build the same layers "
                    f"in the same order on every rank"
                )


def broadcast_buffers(model: nn.Module, src: int, group: Group) -> None:
    """Every rank starts from ``src``'s buffers (e.g. BatchNorm running statistics).
    Communicates: one broadcast per non-empty buffer."""
    for b in model.buffers():
        if b.numel() == 0:
            continue
        staged = b.data if b.is_contiguous() else b.data.contiguous()
        ops.broadcast(staged, src=src, group=group)
        if staged is not b.data:  # a non-contiguous buffer went through a copy: write it back
            with torch.no_grad():
                b.data.copy_(staged)


def build_flats(
    model: nn.Module,
    config: Config,
    stage: ZeroStage,
    group: Group,
    dtypes: Dtypes,
    host: torch.device,
    replicate: Group | None = None,
    deferred: torch.device | None = None,
    *,
    group_of: Callable[[torch.Tensor], Group],
) -> tuple[list[FlatParam], ParamSchedule | None]:
    """The flat buffers (and, stage 3, the gather/free schedule), sharded over ``group`` and
    copied over ``replicate``, holding the first replica's first rank's weights. Communicates:
    a broadcast per flat buffer and group (and per frozen parameter outside one).

    ``group_of``: each parameter's data-parallel group (``group`` for all, by default): they are
    split by it first, then into buckets (stages 0-2) or units (stage 3), each flat buffer
    sharded over its own group. ``deferred`` (a meta model): the buffers are made on that
    device holding zeros, at stage 3 the shards alone, and nothing is broadcast: the engine
    fills them afterwards."""
    of = group_of
    schedule = None
    if not stage.shard_params:
        flats = [
            FlatParam(named, of(named[0][1]), stage, dtypes, trainable, replicate, deferred)
            for named, trainable in buckets(model, config.reduce_bucket_bytes, _ranks_of(of))
        ]
        for p in model.parameters():  # frozen: replicated, never updated: rank 0's, once
            if not p.requires_grad and deferred is None:
                if replicate is not None and replicate.size > 1:
                    ops.broadcast(p.data, src=replicate.ranks[0], group=replicate)
                ops.broadcast(p.data, src=of(p).ranks[0], group=of(p))
    else:
        specs = units(model, tuple(config.wrap_policy) if config.wrap_policy else None)
        by_name: dict[str, list[FlatParam]] = {}
        flats = []
        for spec in specs:
            mine = [
                FlatParam(named, of(named[0][1]), stage, dtypes, flag, replicate, deferred)
                for part in split_by(spec.own, _ranks_of(of))
                for named, flag in zip(split_trainable(part), (True, False))
                if named
            ]
            by_name[spec.name] = mine
            flats += mine
        needs = [by_name[s.name] + [f for n in s.foreign for f in by_name[n]] for s in specs]
        # reductions start in reverse registration order: roughly the backward order; the
        # root unit last, whatever its registration: it holds what the forward uses first
        # (embeddings), so backward finishes it last, and reductions start in list order,
        # which would hold every other unit's full gradients and parameters until then
        root = by_name.get(specs[-1].name, []) if specs[-1].module is model else []
        flats = [f for f in flats[::-1] if f not in root] + root
        schedule = ParamSchedule(
            [s.module for s in specs], needs, config.prefetch_units, root=model
        )
    for f in flats:
        if deferred is None:
            f.broadcast_from(f.group.ranks[0])
        f.finish_init(host)
    return flats, schedule


def _ranks_of(group_of: Callable[[torch.Tensor], Group]) -> Callable[[nn.Parameter], Hashable]:
    """A parameter's data-parallel group as a key to split parameters by."""
    return lambda p: group_of(p).ranks


def cast_outside_flats(model: nn.Module, inside: set[int], dtype: torch.dtype) -> None:
    """Parameters outside flat buffers (frozen, stages 0-2) and floating buffers run in the
    compute dtype too."""
    if dtype == torch.float32:
        return
    for p in model.parameters():
        if id(p) not in inside and p.is_floating_point():
            p.data = p.data.to(dtype)
    for mod in model.modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and b.is_floating_point():
                setattr(mod, name, b.to(dtype))


def build_optimizer(
    model: nn.Module, flats: list[FlatParam], optimizer: zero_opt.OptimizerLike, config: Config
) -> torch.optim.Optimizer:
    """The user's optimizer class and groups, over this rank's shards."""
    shard_of = {}
    for f in flats:
        for pc, op in zip(f.opt_pieces, f.opt_params):
            shard_of[id(f.params[f.slots.index(pc.slot)])] = op
    return zero_opt.rebuild(
        optimizer, list(model.parameters()), shard_of, config.allow_untested_optimizer
    )


def build_scheduler(factory: SchedulerFactory | None, optimizer: torch.optim.Optimizer) -> Any:
    if factory is None:
        return None
    if isinstance(factory, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(
            "pass lr_scheduler as a callable optimizer -> scheduler (e.g. "
            "lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)): the engine "
            "builds its own optimizer over the shards"
        )
    return factory(optimizer)


def backward_args(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    grad_tensors: torch.Tensor | Sequence[torch.Tensor] | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Check ``Engine.backward``'s arguments: a scalar loss, or outputs with matching grads."""
    outs = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not outs or not all(isinstance(t, torch.Tensor) for t in outs):
        raise TypeError("backward needs a loss tensor, or a sequence of output tensors")
    if grad_tensors is None:
        if len(outs) != 1 or outs[0].dim() != 0:
            shapes = [tuple(t.shape) for t in outs]
            raise ValueError(
                f"backward needs a scalar loss, got shape {shapes[0] if len(outs) == 1 else shapes}"
                f"; pass grad_tensors to backpropagate received gradients"
            )
        return outs, None
    grads = [grad_tensors] if isinstance(grad_tensors, torch.Tensor) else list(grad_tensors)
    if len(grads) != len(outs):
        raise ValueError(f"backward got {len(outs)} tensors but {len(grads)} grad_tensors")
    for i, (t, g) in enumerate(zip(outs, grads)):
        if not isinstance(g, torch.Tensor) or g.shape != t.shape:
            got = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            raise ValueError(
                f"grad_tensors[{i}] must be a tensor of shape {tuple(t.shape)}, got {got}"
            )
        if not t.requires_grad:
            raise ValueError(f"tensors[{i}] does not require grad: nothing to backpropagate")
    return outs, grads
