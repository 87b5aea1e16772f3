"""MPI_Comm_split over shardwise groups."""

from __future__ import annotations

import torch

from shardwise.comm import objects, ops
from shardwise.comm.dispatch import check_group
from shardwise.comm.groups import Group


def split(
    color: int | None, key: int = 0, *, group: Group, timeout_s: float | None = None
) -> Group | None:
    """MPI_Comm_split: ranks of ``group`` passing the same ``color`` form one new group, ordered
    by ``key`` then by their rank in ``group``. ``color=None`` (MPI_UNDEFINED) joins no group
    and returns None. Every rank of the group's world must call it (torch forms groups
    collectively).

    Communicates: one all_gather of two int64 per rank over ``group``; when ``group`` is not the
    whole world, a broadcast of the layout from its first rank to the world.
    """
    parent = check_group(group, "split")
    world = parent.world
    if color is not None and color < 0:
        raise ValueError(f"color must be >= 0 or None (no group), got {color}")
    members: dict[int, list[tuple[int, int, int]]] = {}
    if parent.is_member:
        mine = torch.tensor([-1 if color is None else color, key], dtype=torch.int64)
        table = ops.all_gather(mine.unsqueeze(0), group=parent).tolist()
        for grank, (c, k) in enumerate(table):
            if c >= 0:
                members.setdefault(c, []).append((k, grank, parent.ranks[grank]))
    # Groups beyond the parent are formed by the whole world; ranks outside the parent learn the
    # layout from the parent's lowest rank so that every rank calls new_group the same times.
    if parent.size != world.world_size:
        members = objects.broadcast_object(
            members if parent.rank == 0 else None, src=parent.ranks[0], group=world.group
        )
    result = None
    for c in sorted(members):
        ordered = tuple(r for _, _, r in sorted(members[c]))
        g = world.new_group(ordered, timeout_s=timeout_s, name=f"split{c}", stats=parent.stats)
        if world.rank in ordered:
            result = g
    return result
