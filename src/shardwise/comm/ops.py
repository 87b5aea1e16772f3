"""Every tensor collective shardwise issues, over an explicit ``Group``.

These are the library's entry points: each takes its group as a required keyword (a forgotten
group must not silently become the world). Users call the same functions through
``shardwise.comm`` (``facade``), where ``group=None`` means the current world. Each call is
traced, counted in its group's ``CommStats`` and bounded by its group's timeout (``launch``);
on gloo the large all_gather and every reduce_scatter go point-to-point (``p2p``). Each
collective's call signature, with the overloads that type ``async_op=True`` as a ``Handle``, is
written once in ``signatures``: the functions here are published under those types.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm import algorithms, crossing, gloo_exchange
from shardwise.comm.allreduce_rounds import GroupLinks
from shardwise.comm.dispatch import (
    Handle,
    check_group,
    check_reduce,
    check_tensor,
    launch,
    nbytes,
)
from shardwise.comm.gloo_exchange import P2P_ALL_GATHER_MIN_BYTES, finish_avg
from shardwise.comm.groups import Group
from shardwise.comm.send_recv import recv, send
from shardwise.comm.signatures import (
    AllGather,
    AllGatherList,
    AllReduce,
    AllReduceCoalesced,
    AllToAll,
    Barrier,
    Broadcast,
    ReduceScatter,
    publish,
)

__all__ = [
    "P2P_ALL_GATHER_MIN_BYTES",
    "Handle",
    "all_gather",
    "all_gather_list",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "barrier",
    "broadcast",
    "chunk_sizes",
    "recv",
    "reduce_scatter",
    "send",
]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_to_all_single = dist.all_to_all_single


def _all_reduce(
    t: torch.Tensor,
    op: str = "sum",
    *,
    group: Group,
    async_op: bool = False,
    algorithm: str = "native",
    nodes: Sequence[int] | None = None,
    links: GroupLinks | None = None,
) -> torch.Tensor | Handle[torch.Tensor]:
    """Reduce ``t`` in place across the group (``op``: sum, avg, max, min; ``avg`` on gloo is
    a sum then a division).

    Args:
        algorithm: ``"native"`` (the backend's own), ``"ring"``, ``"halving_doubling"``,
            ``"tree"``, ``"hierarchical"`` or ``"auto"`` (``comm.algorithms``).
        nodes: for ``"hierarchical"``, the node of each group rank (default from ``links``,
            else from the environment).
        links: the group's measured links, needed by ``"auto"``.
        async_op: return a ``Handle``; the algorithms other than native complete first.

    Communicates: native: one all_reduce of ``t`` (payload: t's bytes); otherwise the
    algorithm's point-to-point messages (ring and halving-doubling 2(p-1)/p of the tensor per
    rank, tree up to 2 ceil(log2 p) tensors, hierarchical 2(G-1)/G inside the node and
    2(N-1)/(N G) across nodes).
    """
    algorithms.check_algorithm(algorithm)
    g = check_group(group, "all_reduce")
    rop = check_reduce(op, t, "all_reduce")
    if algorithm != "native":
        return algorithms.run(t, op, g, async_op, algorithm, nodes, links)
    return launch(
        "all_reduce",
        g,
        [t],
        nbytes(t),
        lambda: [dist.all_reduce(t, rop, group=g.pg, async_op=True)],
        lambda: finish_avg(t, op, g.size),
        async_op,
        f"op={op}, ",
        inter_node_bytes=crossing.all_reduce(g, t.numel(), t.element_size()),
    )


def _all_reduce_coalesced(
    tensors: Sequence[torch.Tensor], op: str = "sum", *, group: Group
) -> list[torch.Tensor]:
    """All-reduce many small tensors as one flat buffer per dtype (one collective each), then
    copy the results back in place. Communicates: one all_reduce per dtype present."""
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        all_reduce(flat, op, group=group)
        offset = 0
        for t in ts:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
    return list(tensors)


def _broadcast(
    t: torch.Tensor, src: int = 0, *, group: Group, async_op: bool = False
) -> torch.Tensor | Handle[torch.Tensor]:
    """Copy ``t`` from world rank ``src`` to every rank of the group, in place.

    Communicates: broadcast of ``t`` (payload: t's bytes)."""
    g = check_group(group, "broadcast")
    check_tensor(t, "t", "broadcast")
    if src not in g.ranks:
        raise ValueError(f"broadcast: src rank {src} is not in {g}; allowed: {list(g.ranks)}")
    return launch(
        "broadcast",
        g,
        [t],
        nbytes(t),
        lambda: [dist.broadcast(t, src, group=g.pg, async_op=True)],
        lambda: t,
        async_op,
        f"src={src}, ",
        inter_node_bytes=crossing.broadcast(g, src, nbytes(t)),
    )


def _all_gather(
    t: torch.Tensor, *, group: Group, async_op: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor | Handle[torch.Tensor]:
    """Concatenate every rank's ``t`` along dim 0 in group-rank order (a 0-d tensor counts as
    one element). Every rank must pass the same shape; ``t`` may be this rank's chunk of
    ``out``.

    Communicates: all_gather (payload: the gathered output's bytes)."""
    g = check_group(group, "all_gather")
    check_tensor(t, "t", "all_gather")
    src = t.reshape(1) if t.dim() == 0 else t
    shape = (g.size * src.shape[0], *src.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=t.dtype, device=t.device)
    elif tuple(out.shape) != shape or out.dtype != t.dtype:
        raise ValueError(
            f"all_gather: out must have shape {shape} and dtype {t.dtype}, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    elif not out.is_contiguous():
        raise ValueError("all_gather: out is not contiguous")
    if g.size > 1 and dist.get_backend(g.pg) == "gloo" and nbytes(out) >= P2P_ALL_GATHER_MIN_BYTES:
        return gloo_exchange.all_gather(g, src, out, async_op, t)
    full = out
    target = torch.empty_like(full) if g.permuted else full
    if g.size > 1 and src.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
        src = src.clone()  # the input is a slice of the output: not every backend allows that

    def issue() -> list[Any]:
        return [_all_gather_single(target, src, group=g.pg, async_op=True)]

    def finish() -> torch.Tensor:
        if g.size == 1:
            full.copy_(src)
        elif g.permuted:
            chunks = target.chunk(g.size)
            for i in range(g.size):
                full.chunk(g.size)[i].copy_(chunks[g.torch_position(i)])
        return full

    far = crossing.all_gather(g, nbytes(full))
    return launch("all_gather", g, [t], nbytes(full), issue, finish, async_op, inter_node_bytes=far)


def _all_gather_list(t: torch.Tensor, *, group: Group) -> list[torch.Tensor]:
    """Every rank's ``t`` as a list in group-rank order (one all_gather)."""
    full = all_gather(t, group=group)
    return [c.reshape(t.shape) for c in full.chunk(group.size)]


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``n`` rows split into ``parts`` chunks as ``torch.tensor_split`` does: the first
    ``n % parts`` chunks are one longer."""
    q, r = divmod(n, parts)
    return [q + 1 if i < r else q for i in range(parts)]


def _staged_reduce_scatter(
    g: Group, src: torch.Tensor, chunks: list[torch.Tensor], sizes: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, receive buffer) for torch's reduce_scatter, which wants equal chunks in torch's
    rank order: chunk i goes to slot ``torch_position(i)`` of a padded buffer, zero elsewhere."""
    width, rest = sizes[0], src.shape[1:]
    staged = src.new_zeros((g.size * width, *rest))
    for i in range(g.size):
        p = g.torch_position(i)
        staged[p * width : p * width + sizes[i]].copy_(chunks[i])
    return staged, src.new_empty((width, *rest))


def _reduce_scatter(
    t: torch.Tensor,
    op: str = "sum",
    *,
    group: Group,
    async_op: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | Handle[torch.Tensor]:
    """Reduce ``t`` across the group and return this rank's chunk of dim 0 (chunks as
    ``torch.tensor_split``: sizes need not divide). ``out`` may alias this rank's own chunk
    of ``t`` (``t`` is then consumed).

    On gloo the exchange is point-to-point (``gloo_exchange.reduce_scatter``).
    Communicates: reduce_scatter (payload: the unreduced input's bytes).
    """
    g = check_group(group, "reduce_scatter")
    rop = check_reduce(op, t, "reduce_scatter")
    src = t.reshape(-1) if t.dim() == 0 else t
    sizes = chunk_sizes(src.shape[0], g.size)
    offsets = [sum(sizes[:i]) for i in range(g.size)]
    mine, rest = sizes[g.rank], src.shape[1:]
    if out is None:
        out = torch.empty((mine, *rest), dtype=t.dtype, device=t.device)
    elif tuple(out.shape) != (mine, *rest) or out.dtype != t.dtype:
        raise ValueError(
            f"reduce_scatter: out must have shape {(mine, *rest)} and dtype "
            f"{t.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    chunks = [src[offsets[i] : offsets[i] + sizes[i]] for i in range(g.size)]
    if g.size > 1 and dist.get_backend(g.pg) == "gloo":
        return gloo_exchange.reduce_scatter(g, op, chunks, out, async_op, src)
    result = out
    even = len(set(sizes)) == 1 and not g.permuted
    staged, recv_buf = (src, result) if even else _staged_reduce_scatter(g, src, chunks, sizes)

    def issue() -> list[Any]:
        return [_reduce_scatter_single(recv_buf, staged, op=rop, group=g.pg, async_op=True)]

    def finish() -> torch.Tensor:
        if g.size == 1:
            if result.data_ptr() != src.data_ptr():
                result.copy_(src)
        elif recv_buf is not result:
            result.copy_(recv_buf[:mine])
        return finish_avg(result, op, g.size)

    far = crossing.reduce_scatter(g, chunks)
    extra = f"op={op}, "
    return launch(
        "reduce_scatter",
        g,
        [t],
        nbytes(t),
        issue,
        finish,
        async_op,
        extra,
        inter_node_bytes=far,
    )


def _all_to_all(
    t: torch.Tensor, *, group: Group, async_op: bool = False
) -> torch.Tensor | Handle[torch.Tensor]:
    """Split ``t`` into ``group.size`` equal chunks along dim 0, send chunk i to group rank i and
    return the chunks received, in group-rank order, concatenated along dim 0 (same shape as
    ``t``). dim 0 must divide by the group size.

    Communicates: all_to_all (payload: t's bytes; (p-1)/p of them leave this rank)."""
    g = check_group(group, "all_to_all")
    check_tensor(t, "t", "all_to_all")
    if t.dim() == 0 or t.shape[0] % g.size:
        raise ValueError(
            f"all_to_all: dim 0 of shape {tuple(t.shape)} must divide by the group size {g.size}"
        )
    src = t.contiguous()
    chunks = list(src.chunk(g.size))
    out = torch.empty_like(src)
    # torch orders chunks by its own rank order: stage them at their torch positions
    order = sorted(range(g.size), key=g.torch_position)  # group rank at each torch position
    staged = torch.cat([chunks[i] for i in order]) if g.permuted else src
    target = torch.empty_like(src) if g.permuted else out

    def issue() -> list[Any]:
        return [_all_to_all_single(target, staged, group=g.pg, async_op=True)]

    def finish() -> torch.Tensor:
        if g.size == 1:
            out.copy_(src)
        elif g.permuted:
            got = target.chunk(g.size)
            for i in range(g.size):
                out.chunk(g.size)[i].copy_(got[g.torch_position(i)])
        return out

    far = crossing.reduce_scatter(g, chunks)
    return launch("all_to_all", g, [t], nbytes(t), issue, finish, async_op, inter_node_bytes=far)


def _barrier(*, group: Group) -> None:
    """Wait for every rank of the group (gloo names the ranks that did not arrive)."""
    g = check_group(group, "barrier")

    def issue() -> list[Any]:
        if dist.get_backend(g.pg) == "gloo":
            dist.monitored_barrier(
                g.pg, timeout=datetime.timedelta(seconds=g.timeout_s), wait_all_ranks=True
            )
            return []
        return [dist.barrier(group=g.pg, async_op=True)]

    launch("barrier", g, [], 0, issue, lambda: None, False)


all_reduce: AllReduce = publish(_all_reduce, "all_reduce")
all_reduce_coalesced: AllReduceCoalesced = publish(_all_reduce_coalesced, "all_reduce_coalesced")
broadcast: Broadcast = publish(_broadcast, "broadcast")
all_gather: AllGather = publish(_all_gather, "all_gather")
all_gather_list: AllGatherList = publish(_all_gather_list, "all_gather_list")
reduce_scatter: ReduceScatter = publish(_reduce_scatter, "reduce_scatter")
all_to_all: AllToAll = publish(_all_to_all, "all_to_all")
barrier: Barrier = publish(_barrier, "barrier")
