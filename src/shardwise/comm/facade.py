"""The public collectives: ``ops`` with ``group`` optional, where None means the current world
(and a torch ProcessGroup is accepted too). Library code calls ``ops`` with its group instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
from torch.distributed import ProcessGroup

from shardwise.comm import algorithms, mpi_split, objects, ops
from shardwise.comm.allreduce_rounds import GroupLinks
from shardwise.comm.current_world import current, resolve
from shardwise.comm.dispatch import Handle
from shardwise.comm.groups import Group

GroupLike = Group | ProcessGroup | None


@overload
def all_reduce(
    t: torch.Tensor,
    op: str = ...,
    group: GroupLike = ...,
    async_op: Literal[False] = ...,
    algorithm: str = ...,
    nodes: Sequence[int] | None = ...,
    links: GroupLinks | None = ...,
) -> torch.Tensor: ...
@overload
def all_reduce(
    t: torch.Tensor,
    op: str = ...,
    group: GroupLike = ...,
    *,
    async_op: Literal[True],
    algorithm: str = ...,
    nodes: Sequence[int] | None = ...,
    links: GroupLinks | None = ...,
) -> Handle[torch.Tensor]: ...
@overload
def all_reduce(
    t: torch.Tensor,
    op: str,
    group: GroupLike,
    async_op: Literal[True],
    algorithm: str = ...,
    nodes: Sequence[int] | None = ...,
    links: GroupLinks | None = ...,
) -> Handle[torch.Tensor]: ...
def all_reduce(
    t: torch.Tensor,
    op: str = "sum",
    group: GroupLike = None,
    async_op: bool = False,
    algorithm: str = "native",
    nodes: Sequence[int] | None = None,
    links: GroupLinks | None = None,
) -> torch.Tensor | Handle[torch.Tensor]:
    """Reduce ``t`` in place across ``group`` (None: the world) by ``algorithm``; see
    ``algorithms.all_reduce``."""
    return algorithms.all_reduce(
        t,
        op,
        group=resolve(group),
        async_op=async_op,
        algorithm=algorithm,
        nodes=nodes,
        links=links,
    )


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor], op: str = "sum", group: GroupLike = None
) -> list[torch.Tensor]:
    """One all_reduce per dtype over many small tensors; see ``ops.all_reduce_coalesced``."""
    return ops.all_reduce_coalesced(tensors, op, group=resolve(group))


@overload
def broadcast(
    t: torch.Tensor, src: int = ..., group: GroupLike = ..., async_op: Literal[False] = ...
) -> torch.Tensor: ...
@overload
def broadcast(
    t: torch.Tensor, src: int = ..., group: GroupLike = ..., *, async_op: Literal[True]
) -> Handle[torch.Tensor]: ...
def broadcast(
    t: torch.Tensor, src: int = 0, group: GroupLike = None, async_op: bool = False
) -> torch.Tensor | Handle[torch.Tensor]:
    """Copy ``t`` from world rank ``src`` to the group, in place; see ``ops.broadcast``."""
    return ops.broadcast(t, src, group=resolve(group), async_op=async_op)


@overload
def all_gather(
    t: torch.Tensor,
    group: GroupLike = ...,
    async_op: Literal[False] = ...,
    out: torch.Tensor | None = ...,
) -> torch.Tensor: ...
@overload
def all_gather(
    t: torch.Tensor,
    group: GroupLike = ...,
    *,
    async_op: Literal[True],
    out: torch.Tensor | None = ...,
) -> Handle[torch.Tensor]: ...
def all_gather(
    t: torch.Tensor,
    group: GroupLike = None,
    async_op: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | Handle[torch.Tensor]:
    """Every rank's ``t`` concatenated along dim 0; see ``ops.all_gather``."""
    return ops.all_gather(t, group=resolve(group), async_op=async_op, out=out)


def all_gather_list(t: torch.Tensor, group: GroupLike = None) -> list[torch.Tensor]:
    """Every rank's ``t`` as a list in group-rank order (one all_gather)."""
    return ops.all_gather_list(t, group=resolve(group))


@overload
def reduce_scatter(
    t: torch.Tensor,
    op: str = ...,
    group: GroupLike = ...,
    async_op: Literal[False] = ...,
    out: torch.Tensor | None = ...,
) -> torch.Tensor: ...
@overload
def reduce_scatter(
    t: torch.Tensor,
    op: str = ...,
    group: GroupLike = ...,
    *,
    async_op: Literal[True],
    out: torch.Tensor | None = ...,
) -> Handle[torch.Tensor]: ...
def reduce_scatter(
    t: torch.Tensor,
    op: str = "sum",
    group: GroupLike = None,
    async_op: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | Handle[torch.Tensor]:
    """This rank's chunk of ``t`` reduced over the group; see ``ops.reduce_scatter``."""
    return ops.reduce_scatter(t, op, group=resolve(group), async_op=async_op, out=out)


@overload
def send(
    t: torch.Tensor, dst: int, group: GroupLike = ..., async_op: Literal[False] = ...
) -> None: ...
@overload
def send(
    t: torch.Tensor, dst: int, group: GroupLike = ..., *, async_op: Literal[True]
) -> Handle[None]: ...
def send(
    t: torch.Tensor, dst: int, group: GroupLike = None, async_op: bool = False
) -> Handle[None] | None:
    """Send ``t`` to world rank ``dst``; see ``ops.send``."""
    return ops.send(t, dst, group=resolve(group), async_op=async_op)


@overload
def recv(
    t: torch.Tensor, src: int, group: GroupLike = ..., async_op: Literal[False] = ...
) -> torch.Tensor: ...
@overload
def recv(
    t: torch.Tensor, src: int, group: GroupLike = ..., *, async_op: Literal[True]
) -> Handle[torch.Tensor]: ...
def recv(
    t: torch.Tensor, src: int, group: GroupLike = None, async_op: bool = False
) -> torch.Tensor | Handle[torch.Tensor]:
    """Receive into ``t`` from world rank ``src``; see ``ops.recv``."""
    return ops.recv(t, src, group=resolve(group), async_op=async_op)


def barrier(group: GroupLike = None) -> None:
    """Wait for every rank of the group (default: the world)."""
    ops.barrier(group=resolve(group))


def broadcast_object(obj: Any, src: int = 0, group: GroupLike = None) -> Any:
    """``obj`` pickled on world rank ``src``, returned on every rank of the group."""
    return objects.broadcast_object(obj, src, group=resolve(group))


def all_gather_object(obj: Any, group: GroupLike = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order."""
    return objects.all_gather_object(obj, group=resolve(group))


def new_group(
    ranks: list[int] | tuple[int, ...],
    timeout_s: float | None = None,
    name: str | None = None,
    dedicated: bool = False,
) -> Group:
    """A group of the given ranks of the current world; see ``World.new_group``."""
    return current().new_group(ranks, timeout_s=timeout_s, name=name, dedicated=dedicated)


def split(
    color: int | None, key: int = 0, group: GroupLike = None, timeout_s: float | None = None
) -> Group | None:
    """MPI_Comm_split of ``group`` (default: the world); see ``comm.mpi_split.split``."""
    return mpi_split.split(color, key, group=resolve(group), timeout_s=timeout_s)


def world() -> Group:
    """The current world's group of every rank."""
    return current().group


def comm_stats(reset: bool = False) -> dict[str, dict[str, int | float]]:
    """``{op: {"calls", "bytes", "seconds", "inter_node_bytes"}}`` for every op the current
    world issued since the last reset (in any of its groups). ``inter_node_bytes``: what this
    rank sent to other nodes (``shardwise.comm.crossing``; 0 when the nodes are unknown)."""
    return current().stats.snapshot(reset)


def exposed_comm_seconds(reset: bool = False) -> float:
    """Seconds callers of the current world were blocked on communication (time that did not
    overlap compute)."""
    return current().stats.exposed(reset)


def set_debug(enabled: bool | None) -> None:
    """Turn the current world's desync check on or off (None: follow
    SHARDWISE_DEBUG_COLLECTIVES)."""
    current().debug = enabled
