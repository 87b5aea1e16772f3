"""One parameter's full value from its flat buffer's shards, without gathering the buffer.

A flat buffer may hold a whole unit (many parameters); an export that must never hold more
than one output file's tensors gathers each parameter on its own: every rank of the shard
group contributes the part of the parameter's slot that falls in its master slice, the parts
padded to the longest so one equal-sized all_gather carries them, and the real parts are joined
in rank order.
"""

from __future__ import annotations

import torch

from shardwise.comm import ops
from shardwise.zero.flat_param import FlatParam
from shardwise.zero.partition import ParamSlot, shard_range


def slot_pieces(flat: FlatParam, slot: ParamSlot) -> list[tuple[int, int]]:
    """Per rank of ``flat.group``: the ``[start, stop)`` of ``slot`` inside that rank's master
    slice, in flat-buffer coordinates (``start == stop`` where the rank holds none of it)."""
    out = []
    for r in range(flat.group.size):
        lo, hi = shard_range(flat.padded, flat.group.size, r)
        start = min(max(lo, slot.offset), slot.end)
        out.append((start, max(start, min(hi, slot.end))))
    return out


def gather_param_master(flat: FlatParam, slot: ParamSlot) -> torch.Tensor:
    """The whole parameter of ``slot`` at master precision (a new tensor of ``slot.shape``);
    call on every rank of ``flat.group``.

    Communicates (optimizer state sharded): one all_gather over ``flat.group`` of
    ``group.size * longest piece`` elements (about the parameter's size); nothing when every
    rank holds the whole master copy (stage 0).
    """
    if not flat.stage.shard_optimizer:
        return flat.master[slot.offset : slot.end].detach().view(slot.shape).clone()
    pieces = slot_pieces(flat, slot)
    longest = max(stop - start for start, stop in pieces)
    start, stop = pieces[flat.group.rank]
    mine = torch.zeros(longest, dtype=flat.master.dtype, device=flat.device)
    local = flat.master[start - flat.opt_start : stop - flat.opt_start]
    mine[: stop - start].copy_(local.detach())
    gathered = ops.all_gather(mine, group=flat.group)
    assert isinstance(gathered, torch.Tensor)
    parts = [gathered[r * longest : r * longest + (b - a)] for r, (a, b) in enumerate(pieces)]
    return torch.cat(parts).view(slot.shape)
