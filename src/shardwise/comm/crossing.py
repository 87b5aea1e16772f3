"""Bytes that leave this rank for another node, per collective, from the group's members and
the collective's algorithm.

Nodes come from ``shardwise.comm.emulate.env_nodes`` (``SHARDWISE_EMULATE_NODES``, or
torchrun's node-major layout); without them every rank counts as one node and nothing crosses.
The counts are what this rank sends under the direct-exchange algorithms the gloo paths run
(``shardwise.comm.gloo_exchange``), used as the model for the backend's own collectives too:

- all_gather: this rank's chunk, once to every member on another node;
- reduce_scatter: chunk ``j`` of the input to group rank ``j``, for each ``j`` on another node;
- all_reduce (native): a reduce_scatter then an all_gather of the tensor split into
  ``tensor_split`` chunks by element (the bandwidth-optimal exchange); the point-to-point
  algorithms of ``comm.algorithms`` count their ``send`` messages instead;
- broadcast: the tensor from the source to every member on another node;
- send: the message when the destination is on another node (recv counts nothing).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from shardwise.comm import emulate
from shardwise.comm.groups import Group

_cache: dict[tuple[str, str, str, int], tuple[int, ...] | None] = {}


def nodes(world_size: int) -> tuple[int, ...] | None:
    """The node of every global rank (parsed once per setting), or None when unknown."""
    env = os.environ
    key = (
        env.get(emulate.NODES_ENV, ""),
        env.get("GROUP_RANK", ""),
        env.get("LOCAL_WORLD_SIZE", ""),
        world_size,
    )
    if key not in _cache:
        _cache[key] = emulate.env_nodes(world_size)
    return _cache[key]


def off_node(group: Group) -> list[int]:
    """Group ranks of the members on another node than this rank."""
    where = nodes(group.world.world_size)
    if where is None:
        return []
    mine = where[group.world.rank]
    return [j for j, r in enumerate(group.ranks) if where[r] != mine]


def split_bytes(numel: int, parts: int, item_bytes: int) -> list[int]:
    """Bytes of each ``tensor_split`` chunk of ``numel`` items of ``item_bytes`` bytes."""
    q, r = divmod(numel, parts)
    return [(q + 1 if i < r else q) * item_bytes for i in range(parts)]


def all_gather(group: Group, out_bytes: int) -> int:
    return len(off_node(group)) * (out_bytes // group.size)


def reduce_scatter(group: Group, chunks: Sequence[torch.Tensor]) -> int:
    """``chunks``: the input's chunk for each group rank."""
    return sum(chunks[j].numel() * chunks[j].element_size() for j in off_node(group))


def all_reduce(group: Group, numel: int, element_bytes: int) -> int:
    chunks = split_bytes(numel, group.size, element_bytes)
    far = off_node(group)
    return sum(chunks[j] for j in far) + len(far) * chunks[group.rank]


def broadcast(group: Group, src: int, nbytes: int) -> int:
    return len(off_node(group)) * nbytes if group.world.rank == src else 0


def send(group: Group, dst: int, nbytes: int) -> int:
    where = nodes(group.world.world_size)
    if where is None:
        return 0
    return nbytes if where[dst] != where[group.world.rank] else 0
