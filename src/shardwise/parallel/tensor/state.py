"""Unsharded views of a tensor-parallel model's state: gather shards, cut padding; and back."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from shardwise.parallel.placement import GroupOf, Placement


def full_state_dict(
    model: nn.Module, placements: Mapping[int, Placement], group_of: GroupOf
) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every tp-sharded tensor gathered and unpadded (detached
    copies). Communicates: one all_gather over tp per distinct sharded tensor."""
    own = model.state_dict(keep_vars=True)
    by_name = {name: placements[id(t)] for name, t in own.items() if id(t) in placements}
    tied = {name: id(t) for name, t in own.items()}
    return gather_state_dict(own, by_name, group_of, tied)


def gather_state_dict(
    local: Mapping[str, torch.Tensor],
    placements: Mapping[str, Placement],
    group_of: GroupOf,
    same: Mapping[str, object] | None = None,
) -> dict[str, torch.Tensor]:
    """Gather a tp-local state dict (this rank's shards under the original names, e.g. an
    engine's ``state_dict()``) into the full one, padding removed. ``same`` maps names that
    hold one tensor to one key, gathered once. Communicates: one all_gather over tp per
    distinct sharded entry, in name order (the same on every tp rank)."""
    done: dict[object, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in local.items():
        p = placements.get(name)
        if p is None or not p.shards:
            out[name] = t.detach().clone()
            continue
        key = name if same is None else same[name]
        if key not in done:
            with torch.no_grad():
                done[key] = p.gather_full(t.detach(), group_of).clone()
        out[name] = done[key]
    return out


def load_full_state_dict(
    model: nn.Module, placements: Mapping[int, Placement], full: Mapping[str, torch.Tensor]
) -> None:
    """Copy this rank's shard of every entry of ``full`` into ``model``. Communicates nothing."""
    own = model.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(full))
    if missing:
        raise ValueError(f"full state dict lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    with torch.no_grad():
        for name, t in own.items():
            p = placements.get(id(t))
            src = full[name]
            if p is None:
                if tuple(src.shape) != tuple(t.shape):
                    raise ValueError(
                        f"{name}: expected shape {tuple(t.shape)}, got {tuple(src.shape)}"
                    )
                t.copy_(src)
            else:
                t.copy_(p.shard_of(src.to(t.dtype)))
