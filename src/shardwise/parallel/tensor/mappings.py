"""Conjugate autograd functions that move activations in and out of tensor-parallel regions.

Each pair is one collective in forward and its conjugate in backward (Shoeybi et al. 2019,
sec. 3, the f and g operators; Korthikanti et al. 2022, sec. 4.2.2, for the sequence pairs):

    copy_to_tp         identity            | all_reduce of the gradient
    reduce_from_tp     all_reduce          | identity
    gather_last_dim    all_gather (last)   | take this rank's slice
    gather_sequence    all_gather (seq)    | reduce_scatter (seq)
    scatter_sequence   reduce_scatter (seq)| all_gather (seq)
    slice_sequence     take this rank's    | pad the gradient with zeros (the parameters behind
                       slice of the seq    | it are replicated and reduced over tp at step end)
    split_sequence     take this rank's    | all_gather (seq): every rank's input gets the whole
                       slice of the seq    | sequence's gradient

Every collective goes through ``shardwise.comm.ops`` with the tp group passed explicitly, so all
bytes are counted in ``comm_stats()``. The sequence dim of an activation is dim 1
(``[batch, seq, hidden]``).
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.comm import ops
from shardwise.comm.groups import Group

SEQ_DIM = 1


def _all_reduce(t: torch.Tensor, group: Group) -> torch.Tensor:
    ops.all_reduce(t, op="sum", group=group)
    return t


def gather_dim(t: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` (group-rank order)."""
    front = t.movedim(dim, 0).contiguous()
    out = ops.all_gather(front, group=group)
    assert isinstance(out, torch.Tensor)
    return out.movedim(0, dim)


def _reduce_scatter_dim(t: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum ``t`` over the group and keep this rank's equal chunk of ``dim``."""
    front = t.movedim(dim, 0).contiguous()
    out = ops.reduce_scatter(front, op="sum", group=group)
    assert isinstance(out, torch.Tensor)
    return out.movedim(0, dim)


def all_reduce_grad(grad: torch.Tensor, group: Group) -> torch.Tensor:
    """A gradient hook: the sum over ``group`` of this backward's gradient (a new tensor)."""
    return _all_reduce(grad.clone(memory_format=torch.contiguous_format), group)


def _my_slice(t: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    n = t.shape[dim]
    if n % group.size:
        raise ValueError(
            f"dim {dim} of size {n} does not divide by the tp size {group.size}; "
            "under sequence parallelism the sequence length must be a multiple of tp"
        )
    chunk = n // group.size
    return t.narrow(dim, group.rank * chunk, chunk)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        # an alias that is not an autograd view of x, so it holds no reference to x
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # a private contiguous copy: autograd may hand the same gradient to other branches
        return _all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return gather_dim(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _my_slice(grad, grad.dim() - 1, ctx.group).contiguous(), None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return gather_dim(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_dim(grad, SEQ_DIM, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        _my_slice(x, SEQ_DIM, group)  # checks divisibility before any bytes move
        return _reduce_scatter_dim(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_dim(grad, SEQ_DIM, ctx.group), None


class _SliceSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.shape = dim, group, x.shape
        return _my_slice(x, dim, group).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        full = grad.new_zeros(ctx.shape)
        _my_slice(full, ctx.dim, ctx.group).copy_(grad)
        return full, None, None


class _SplitSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _my_slice(x, SEQ_DIM, group).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_dim(grad, SEQ_DIM, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a tp region with a replicated input: identity; backward all_reduces the grad."""
    return _CopyToTP.apply(x, group) if group.size > 1 else x


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a tp region by summing partial outputs: all_reduce; backward identity."""
    return _ReduceFromTP.apply(x, group) if group.size > 1 else x


def gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate the ranks' last-dim shards: all_gather; backward keeps this rank's slice."""
    return _GatherLastDim.apply(x, group) if group.size > 1 else x


def gather_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a tp region from a sequence-parallel one: all_gather of dim 1; backward
    reduce_scatter of dim 1."""
    return _GatherSequence.apply(x, group) if group.size > 1 else x


def scatter_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a tp region into a sequence-parallel one: reduce_scatter of dim 1 (sums the
    partial outputs); backward all_gather of dim 1."""
    return _ScatterSequence.apply(x, group) if group.size > 1 else x


def slice_sequence(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's slice of a replicated tensor along ``dim``; no communication either way."""
    return _SliceSequence.apply(x, dim, group) if group.size > 1 else x


def split_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a sequence-parallel region from a replicated tensor: this rank's slice of dim 1;
    backward all_gather of dim 1 (what produced ``x`` gets the whole sequence's gradient)."""
    return _SplitSequence.apply(x, group) if group.size > 1 else x
