"""Reading and writing a model's full parameters while an engine shards them.

At ZeRO stage 3 a parameter's values exist only as shards between uses: outside forward and
backward any read of its values raises (see ``zero.sharded_param``), and
``model.state_dict()`` raises. :func:`gathered_parameters` is the supported way in: it gathers
the full parameters for the duration of a ``with`` block and, with ``modifier_rank``, writes
that rank's changes back into every shard and the fp32 master copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from shardwise.comm import ops
from shardwise.engine.placements import EnginePlacements
from shardwise.zero.flat_param import FlatParam, ParamState
from shardwise.zero.partition import ParamSlot

_OWNED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> True, once an engine has it


def check_unclaimed(model: nn.Module) -> None:
    """Raises ValueError if a parameter of ``model`` was already given to an engine
    (``initialize`` on this model, or on one sharing its parameters, before)."""
    for name, p in model.named_parameters():
        if p in _OWNED:
            raise ValueError(
                f"parameter {name!r} was already given to shardwise.initialize, which rebuilt "
                f"it into flat buffers: a model is initialized once (use the engine it "
                f"returned, or build a new model)"
            )


def claim(model: nn.Module) -> None:
    """Mark ``model``'s parameters as rebuilt by an engine."""
    for p in model.parameters():
        _OWNED[p] = True


def guard_state_dict(model: nn.Module, flats: list[FlatParam]) -> list[Any]:
    """Make ``state_dict()`` of ``model`` (and of its submodules) raise a clear error while
    parameters are sharded (``keep_vars=True`` still returns the parameter objects). Returns
    the hook handles."""
    if not any(f.stage.shard_params for f in flats):
        return []
    owners = {id(p) for f in flats for p in f.params}

    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if keep_vars or all(f.state is ParamState.FULL for f in flats):
            return
        raise RuntimeError(
            f"{prefix.rstrip('.') or 'the model'}: its parameters are sharded (ZeRO stage 3), "
            f"so its state_dict() has no values; use engine.state_dict() for the full state, "
            f"or read them inside `with engine.gathered_parameters():`"
        )

    return [
        m.register_state_dict_pre_hook(hook)
        for m in model.modules()
        if any(id(p) in owners for p in m.parameters())
    ]


def _flats_of(
    flats: list[FlatParam], params: Iterable[torch.Tensor] | torch.Tensor | None
) -> list[FlatParam]:
    if params is None:
        return list(flats)
    ids = {id(params)} if isinstance(params, torch.Tensor) else {id(p) for p in params}
    known = {id(p) for f in flats for p in f.params}
    if ids - known:
        raise ValueError(
            f"{len(ids - known)} of the given parameters are not the engine's (pass parameters "
            f"of engine.module)"
        )
    return [f for f in flats if any(id(p) in ids for p in f.params)]


@contextmanager
def gathered_parameters(
    flats: list[FlatParam],
    params: Iterable[torch.Tensor] | torch.Tensor | None = None,
    modifier_rank: int | None = None,
) -> Iterator[None]:
    """Full parameters inside the block (all, or the flat buffers holding ``params``); call on
    every rank of the group. On exit (stage 3) they are sharded again; with ``modifier_rank``
    (a rank of the group), that rank's values first become everyone's: each parameter it changed
    is written into every copy (shards, fp32 master) on every rank. Forward and backward inside
    the block are not supported (they free parameters).

    Communicates: (stage 3) an all_gather per flat buffer; with ``modifier_rank``, a broadcast of
    each flat buffer.
    """
    chosen = _flats_of(flats, params)
    if modifier_rank is not None and chosen and chosen[0].replicate is not None:
        raise ValueError(
            "gathered_parameters(modifier_rank=...) is not supported with hierarchical sharding "
            "(Mesh dp_replicate > 1): one rank's changes would reach its shard group only; "
            "use engine.load_state_dict on every rank instead"
        )
    if modifier_rank is not None and chosen and modifier_rank not in chosen[0].group.ranks:
        raise ValueError(
            f"modifier_rank={modifier_rank} is not a rank of the engine's group "
            f"{list(chosen[0].group.ranks)}"
        )
    for f in chosen:
        f.gather(async_op=True)
    for f in chosen:
        f.wait_gather()
    before = [f.full.clone() for f in chosen] if modifier_rank is not None else []
    try:
        yield
        freed = [f for f in chosen if f.state is not ParamState.FULL]
        if freed:
            raise RuntimeError(
                f"{len(freed)} flat buffer(s) were sharded again inside gathered_parameters "
                f"(a forward or backward frees them); run forward and backward outside the block"
            )
        if modifier_rank is not None:
            _write_back(chosen, before, modifier_rank)
    finally:
        for f in chosen:
            f.release()


def _write_back(chosen: list[FlatParam], before: list[torch.Tensor], src: int) -> None:
    for f, old in zip(chosen, before):
        ops.broadcast(f.full, src=src, group=f.group)
        for slot in f.slots:
            new = f.full[slot.offset : slot.end]
            if not torch.equal(new, old[slot.offset : slot.end]):
                f.load_param(slot, new.clone())


def full_state_dict(
    module: nn.Module, flats: list[FlatParam], placements: EnginePlacements
) -> dict[str, torch.Tensor]:
    """``module``'s full state keyed by its own names, parameters at master precision (copies).
    A parameter split by a parallel layer (its placement shards it, e.g. over tp) is gathered
    whole, padding cut: the state of the model before it was split.

    Communicates (optimizer sharded): an all_gather per flat buffer; then one all_gather per
    split parameter and split axis (each tied parameter once), in state-dict order."""
    values: dict[int, torch.Tensor] = {}
    for f in flats:
        full = f.full_master()
        for slot, p in zip(f.slots, f.params):
            values[id(p)] = full[slot.offset : slot.end].view(slot.shape).clone()
    out = {}
    whole: dict[int, torch.Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        v = values.get(id(t))
        v = v if v is not None else t.detach().clone()
        where = placements.get(t)
        if where is not None and where.shards:
            if id(t) not in whole:
                whole[id(t)] = where.gather_full(v, placements.group)
            v = whole[id(t)]
        out[name] = v
    return out


def load_full_state_dict(
    module: nn.Module,
    where: dict[int, tuple[FlatParam, ParamSlot]],
    state: dict[str, torch.Tensor],
    device: torch.device,
    placements: EnginePlacements,
) -> None:
    """Write a full state (as ``full_state_dict`` returns) into every copy this rank keeps;
    ``where`` maps a parameter's id to its flat buffer and slot. A split parameter keeps this
    rank's piece of the whole tensor. Communicates nothing."""
    own = module.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for name, t in own.items():
        found = where.get(id(t))
        split = placements.get(t)
        value = state[name]
        whole = split.full_shape if split is not None else tuple(t.shape)
        if tuple(value.shape) != whole:
            raise ValueError(
                f"state dict entry {name} has shape {tuple(value.shape)}, the model's is {whole}"
            )
        if split is not None and split.shards:
            value = split.shard_of(value)
        if found is not None:
            found[0].load_param(found[1], value.to(device))
        else:
            with torch.no_grad():
                t.data.copy_(value)
