"""All-to-all attention (DeepSpeed-Ulysses, Jacobs et al. 2023, sec. 3): exact attention over a
sequence split across the cp ranks, by trading the split: an all_to_all turns this rank's
tokens of every head into every token of 1/cp of the heads, attention runs whole on those heads,
and a second all_to_all turns the output back.

Heads and key/value heads (grouped-query attention) must divide by cp.

Communicates per call and rank: forward one all_to_all each of Q, K, V and the output, backward
one each of their gradients; each moves this rank's piece ((cp - 1)/cp of it leaves the rank).
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.comm import ops
from shardwise.comm.groups import Group
from shardwise.parallel.context import blocks
from shardwise.parallel.context.layout import SequenceLayout


def _seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[b, heads, s/cp, d]`` (this rank's tokens) -> ``[b, heads/cp, s, d]`` (every rank's
    tokens in cp-rank order, this rank's heads)."""
    b, h, s, d = x.shape
    c = group.size
    parts = x.reshape(b, c, h // c, s, d).transpose(0, 1).contiguous()  # [cp, b, h/cp, s/cp, d]
    got = ops.all_to_all(parts, group=group)  # [cp (source rank), b, h/cp, s/cp, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s, d)


def _heads_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The inverse of ``_seq_to_heads``."""
    b, hc, s_full, d = x.shape
    c = group.size
    parts = x.reshape(b, hc, c, s_full // c, d).permute(2, 0, 1, 3, 4).contiguous()
    got = ops.all_to_all(parts, group=group)  # [cp (head group), b, h/cp, s/cp, d]
    # stored as [b, s/cp, h, d] (the model's layout after attention: its transpose back is
    # then a view, and the output projection keeps no copy of it)
    seq_major = got.permute(1, 3, 0, 2, 4).reshape(b, s_full // c, c * hc, d)
    return seq_major.transpose(1, 2)


class SeqToHeads(torch.autograd.Function):
    """``_seq_to_heads`` whose backward is ``_heads_to_seq`` of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """``_heads_to_seq`` whose backward is ``_seq_to_heads`` of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def check_heads(heads: int, kv_heads: int, cp_size: int, where: str) -> None:
    """ValueError naming the numbers unless both head counts divide by cp."""
    if heads % cp_size or kv_heads % cp_size:
        raise ValueError(
            f"{where}: all-to-all context parallelism splits heads over cp={cp_size}, but the "
            f"attention has {heads} heads and {kv_heads} key/value heads; both must divide by "
            "cp (use ring attention, method='ring', or a cp dividing both)"
        )


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    layout: SequenceLayout,
    causal: bool,
    scale: float,
    key_valid: torch.Tensor | None,
    where: str = "attention",
) -> torch.Tensor:
    """Exact attention of this rank's ``q`` [b, h, s/cp, d] over the whole sequence's keys
    (``k``, ``v`` [b, kv_heads, s/cp, d] on every rank); returns [b, h, s/cp, d]."""
    c = group.size
    check_heads(q.shape[1], k.shape[1], c, where)
    qh, kh, vh = (SeqToHeads.apply(t.contiguous(), group) for t in (q, k, v))
    local = q.shape[2]
    pos = torch.cat([layout.positions_of(r, local, q.device) for r in range(c)])
    out = blocks.WholeAttention.apply(qh, kh, vh, pos, pos, causal, key_valid, scale)
    result: torch.Tensor = HeadsToSeq.apply(out.to(q.dtype), group)
    return result
