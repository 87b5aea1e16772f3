"""Forming a torch process group among its members alone, at its first use.

torch's ``new_group`` needs every rank of the world, in one order, for every group; its
``use_local_synchronization=True`` lets only the members call, but names the group by a hash of
its ranks, so forming the same ranks again after the first group was destroyed meets the first
one's rendezvous keys still in the store, and fails to connect. Here the name also carries a
generation counted in the store: each member adds one to the rank set's counter before forming,
and since no member can finish forming generation g before every member has joined it, the n
members of one formation all read values in ``[g*n + 1, (g+1)*n]``.

This reaches into torch's group-creation helper, the one path that takes a chosen name; it is
kept to this module.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed import distributed_c10d as c10d

_GROUP_NAME: Any = getattr(c10d, "GroupName", str)  # a str subtype in recent torch, str before


def can_form_locally(backend: str) -> bool:
    """Whether groups can form among their members alone: not on MPI (no group-local
    rendezvous), nor where the default group is bound to a device (torch then splits every
    new communicator from it, which needs every rank)."""
    if backend == "mpi" or not dist.is_initialized():
        return False
    return getattr(c10d._get_default_group(), "bound_device_id", None) is None


def form_among_members(ranks: tuple[int, ...], timeout_s: float) -> ProcessGroup:
    """torch's process group over the world ranks ``ranks`` (sorted, this rank among them),
    formed by them alone; blocks until every member has called it."""
    ranks = tuple(sorted(ranks))
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} cannot form a group of ranks {list(ranks)} it is not in")
    store = c10d._get_default_store()
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    generation = (store.add(f"shardwise/on-use/{digest}", 1) - 1) // len(ranks)
    name = _GROUP_NAME(f"shardwise-{digest}-{generation}")
    backend = dist.get_backend(c10d._get_default_group())
    pg, _ = c10d._new_process_group_helper(
        len(ranks),
        ranks.index(me),
        list(ranks),
        backend,
        store,
        group_name=name,
        timeout=datetime.timedelta(seconds=timeout_s),
        group_desc=f"shardwise on-use group {list(ranks)}",
    )
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


def is_live(pg: ProcessGroup) -> bool:
    """Whether ``pg`` is still registered with torch (not destroyed)."""
    return pg in c10d._world.pg_map
