"""Unsharded views of a tensor-parallel model's state: gather shards, cut padding; and back."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from shardwise.comm.groups import Group
from shardwise.tp import mappings
from shardwise.tp.placement import TPPlacement


def full_state_dict(
    model: nn.Module, placements: Mapping[int, TPPlacement], group: Group
) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every tp-sharded tensor gathered and unpadded (detached
    copies). Communicates: one all_gather over ``group`` per distinct sharded tensor."""
    gathered: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        p = placements.get(id(t))
        if p is None or not p.sharded:
            out[name] = t.detach().clone()
            continue
        if id(t) not in gathered:
            assert p.dim is not None
            with torch.no_grad():
                gathered[id(t)] = p.unpad(mappings.gather_dim(t.detach(), p.dim, group)).clone()
        out[name] = gathered[id(t)]
    return out


def load_full_state_dict(
    model: nn.Module, placements: Mapping[int, TPPlacement], full: Mapping[str, torch.Tensor]
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
                t.copy_(p.shard(src.to(t.dtype)))
