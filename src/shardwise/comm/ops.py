"""Every tensor collective shardwise issues, over an explicit ``Group``.

These are the library's entry points: each takes its group as a required keyword (a forgotten
group must not silently become the world). Users call the same functions through
``shardwise.comm`` (``facade``), where ``group=None`` means the current world. Each call is
traced, counted in its group's ``CommStats`` and bounded by its group's timeout (``launch``);
on gloo the large all_gather and every reduce_scatter go point-to-point (``p2p``).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from shardwise.comm import crossing, emulate, gloo_exchange
from shardwise.comm.dispatch import Handle, check_group, check_tensor, launch, nbytes
from shardwise.comm.gloo_exchange import P2P_ALL_GATHER_MIN_BYTES, finish_avg
from shardwise.comm.groups import Group

__all__ = [
    "P2P_ALL_GATHER_MIN_BYTES",
    "Handle",
    "all_gather",
    "all_gather_list",
    "all_reduce",
    "all_reduce_coalesced",
    "barrier",
    "broadcast",
    "chunk_sizes",
    "recv",
    "reduce_scatter",
    "send",
]

REDUCE_OPS: dict[str, Any] = {  # torch's ReduceOp members (typed RedOpType)
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce_op(op: str, name: str) -> Any:
    if op not in REDUCE_OPS:
        raise ValueError(f"{name}: unknown reduce op {op!r}; allowed: {', '.join(REDUCE_OPS)}")
    return REDUCE_OPS[op]


@overload
def all_reduce(
    t: torch.Tensor, op: str = ..., *, group: Group, async_op: Literal[False] = ...
) -> torch.Tensor: ...
@overload
def all_reduce(
    t: torch.Tensor, op: str = ..., *, group: Group, async_op: Literal[True]
) -> Handle[torch.Tensor]: ...
@overload
def all_reduce(
    t: torch.Tensor, op: str = ..., *, group: Group, async_op: bool
) -> torch.Tensor | Handle[torch.Tensor]: ...
def all_reduce(
    t: torch.Tensor, op: str = "sum", *, group: Group, async_op: bool = False
) -> torch.Tensor | Handle[torch.Tensor]:
    """Reduce ``t`` in place across the group. ``avg`` on gloo is a sum then a division.

    Communicates: all_reduce of ``t`` (payload: t's bytes).
    """
    g = check_group(group, "all_reduce")
    rop = _reduce_op(op, "all_reduce")
    check_tensor(t, "t", "all_reduce")
    if op == "avg" and not t.is_floating_point():
        raise TypeError(f"all_reduce: op 'avg' needs a floating dtype, got {t.dtype}")
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


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor], op: str = "sum", *, group: Group
) -> list[torch.Tensor]:
    """All-reduce many small tensors as one flat buffer per dtype (one collective each), then
    copy the results back in place. Communicates: one all_reduce per dtype present."""
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        all_reduce(flat, op=op, group=group)
        offset = 0
        for t in ts:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
    return list(tensors)


@overload
def broadcast(
    t: torch.Tensor, src: int = ..., *, group: Group, async_op: Literal[False] = ...
) -> torch.Tensor: ...
@overload
def broadcast(
    t: torch.Tensor, src: int = ..., *, group: Group, async_op: Literal[True]
) -> Handle[torch.Tensor]: ...
@overload
def broadcast(
    t: torch.Tensor, src: int = ..., *, group: Group, async_op: bool
) -> torch.Tensor | Handle[torch.Tensor]: ...
def broadcast(
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


@overload
def all_gather(
    t: torch.Tensor,
    *,
    group: Group,
    async_op: Literal[False] = ...,
    out: torch.Tensor | None = ...,
) -> torch.Tensor: ...
@overload
def all_gather(
    t: torch.Tensor, *, group: Group, async_op: Literal[True], out: torch.Tensor | None = ...
) -> Handle[torch.Tensor]: ...
@overload
def all_gather(
    t: torch.Tensor, *, group: Group, async_op: bool, out: torch.Tensor | None = ...
) -> torch.Tensor | Handle[torch.Tensor]: ...
def all_gather(
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


def all_gather_list(t: torch.Tensor, *, group: Group) -> list[torch.Tensor]:
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


@overload
def reduce_scatter(
    t: torch.Tensor,
    op: str = ...,
    *,
    group: Group,
    async_op: Literal[False] = ...,
    out: torch.Tensor | None = ...,
) -> torch.Tensor: ...
@overload
def reduce_scatter(
    t: torch.Tensor,
    op: str = ...,
    *,
    group: Group,
    async_op: Literal[True],
    out: torch.Tensor | None = ...,
) -> Handle[torch.Tensor]: ...
@overload
def reduce_scatter(
    t: torch.Tensor,
    op: str = ...,
    *,
    group: Group,
    async_op: bool,
    out: torch.Tensor | None = ...,
) -> torch.Tensor | Handle[torch.Tensor]: ...
def reduce_scatter(
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
    rop = _reduce_op(op, "reduce_scatter")
    check_tensor(t, "t", "reduce_scatter")
    if op == "avg" and not t.is_floating_point():
        raise TypeError(f"reduce_scatter: op 'avg' needs a floating dtype, got {t.dtype}")
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


@overload
def send(t: torch.Tensor, dst: int, *, group: Group, async_op: Literal[False] = ...) -> None: ...
@overload
def send(t: torch.Tensor, dst: int, *, group: Group, async_op: Literal[True]) -> Handle[None]: ...
@overload
def send(t: torch.Tensor, dst: int, *, group: Group, async_op: bool) -> Handle[None] | None: ...
def send(t: torch.Tensor, dst: int, *, group: Group, async_op: bool = False) -> Handle[None] | None:
    """Send ``t`` to world rank ``dst``. Communicates: t's bytes."""
    g = check_group(group, "send")
    check_tensor(t, "t", "send")
    if dst not in g.ranks or dst == g.ranks[g.rank]:
        raise ValueError(f"send: dst {dst} must be another rank of {g}")

    def issue() -> list[Any]:
        emulate.delay_send(g.world.rank, dst, nbytes(t), g.world.world_size)
        return [dist.isend(t, dst, group=g.pg)]

    far = crossing.send(g, dst, nbytes(t))
    res = launch("send", g, [t], nbytes(t), issue, lambda: None, async_op, inter_node_bytes=far)
    return res if async_op else None


@overload
def recv(
    t: torch.Tensor, src: int, *, group: Group, async_op: Literal[False] = ...
) -> torch.Tensor: ...
@overload
def recv(
    t: torch.Tensor, src: int, *, group: Group, async_op: Literal[True]
) -> Handle[torch.Tensor]: ...
@overload
def recv(
    t: torch.Tensor, src: int, *, group: Group, async_op: bool
) -> torch.Tensor | Handle[torch.Tensor]: ...
def recv(
    t: torch.Tensor, src: int, *, group: Group, async_op: bool = False
) -> torch.Tensor | Handle[torch.Tensor]:
    """Receive into ``t`` from world rank ``src``. Communicates: t's bytes."""
    g = check_group(group, "recv")
    check_tensor(t, "t", "recv")
    if src not in g.ranks or src == g.ranks[g.rank]:
        raise ValueError(f"recv: src {src} must be another rank of {g}")
    return launch(
        "recv", g, [t], nbytes(t), lambda: [dist.irecv(t, src, group=g.pg)], lambda: t, async_op
    )


def barrier(*, group: Group) -> None:
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
