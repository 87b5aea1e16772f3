"""The public collectives: ``ops`` with ``group`` optional, where None means the current world
(and a torch ProcessGroup is accepted too). Library code calls ``ops`` with its group instead.

Each function here is its ``ops`` function behind one wrapper, ``on_current_world``: the
signatures are ``ops``' (``signatures``), with ``group`` defaulting to None.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

from shardwise.comm import links, mpi_split, objects, ops
from shardwise.comm.current_world import current, resolve
from shardwise.comm.groups import Group
from shardwise.comm.signatures import (
    AllGather,
    AllGatherList,
    AllReduce,
    AllReduceCoalesced,
    AllToAll,
    Barrier,
    Broadcast,
    GroupLike,
    Recv,
    ReduceScatter,
    Send,
)

F = TypeVar("F", bound=Callable[..., Any])


def on_current_world(fn: F, prepare: Callable[[Group, dict[str, Any]], None] | None = None) -> F:
    """``fn`` (an ``ops`` function) with its keyword ``group`` optional: None is the current
    world, a torch ProcessGroup is adopted into it. ``prepare(group, kwargs)`` may fill in
    further arguments from the resolved group before the call."""

    @functools.wraps(fn)
    def call(*args: Any, group: GroupLike = None, **kwargs: Any) -> Any:
        g = resolve(group)
        if prepare is not None:
            prepare(g, kwargs)
        return fn(*args, group=g, **kwargs)

    sig = inspect.signature(fn)
    params = [
        p.replace(default=None, annotation="GroupLike") if name == "group" else p
        for name, p in sig.parameters.items()
    ]
    cast(Any, call).__signature__ = sig.replace(parameters=params)
    return cast(F, call)


all_reduce: AllReduce = on_current_world(ops.all_reduce, links.fill_in)
all_reduce_coalesced: AllReduceCoalesced = on_current_world(ops.all_reduce_coalesced)
broadcast: Broadcast = on_current_world(ops.broadcast)
all_gather: AllGather = on_current_world(ops.all_gather)
all_gather_list: AllGatherList = on_current_world(ops.all_gather_list)
reduce_scatter: ReduceScatter = on_current_world(ops.reduce_scatter)
all_to_all: AllToAll = on_current_world(ops.all_to_all)
send: Send = on_current_world(ops.send)
recv: Recv = on_current_world(ops.recv)
barrier: Barrier = on_current_world(ops.barrier)


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
