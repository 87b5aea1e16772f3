"""A model's context-parallel record: its cp group, the sequence layout, the attention method,
and the batch's padding mask; exact attention over the cp axis by either method.

Everything outside attention works token by token, so it runs on this rank's tokens unchanged;
attention is the one place that needs the other ranks' keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.comm import ops
from shardwise.comm.groups import Group
from shardwise.parallel.context.all_to_all import all_to_all_attention
from shardwise.parallel.context.layout import SequenceLayout
from shardwise.parallel.context.ring import RingAttention

METHODS = ("ring", "all_to_all")
"""ring: K/V blocks travel around the cp ring (any head count); all_to_all: heads and key/value
heads split over cp for the attention (DeepSpeed-Ulysses; both must divide by cp)."""


def check_method(method: object) -> str:
    if method not in METHODS:
        raise ValueError(f"context-parallel method {method!r}: allowed are {METHODS}")
    return str(method)


@dataclass(eq=False)
class ContextParallel:
    """A model's context parallelism over ``group`` (the mesh's cp axis).

    Feed each rank ``split(...)`` of the batch: its tokens (``layout``), the same for inputs,
    targets and position ids; a padding mask given there stays for the forwards until the next
    ``split``. The loss over all cp ranks' tokens is ``loss``."""

    group: Group
    method: str
    layout: SequenceLayout = field(init=False)
    key_valid: torch.Tensor | None = None
    """[batch, seq] bool over the whole sequence (False: padding), or None."""

    def __post_init__(self) -> None:
        check_method(self.method)
        self.layout = SequenceLayout(self.group.size, self.group.rank)

    @property
    def size(self) -> int:
        return self.group.size

    def split(
        self, *full: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """This rank's tokens of each ``full`` tensor ([batch, seq, ...] -> [batch, seq / cp,
        ...]); ``attention_mask`` [batch, seq] (1 or True: a real token) is kept whole for the
        attention and its split returned last. Every cp rank passes the same whole batch."""
        pieces = [self.layout.split(t, dim=1) for t in full]
        self.key_valid = None
        if attention_mask is not None:
            self.key_valid = attention_mask.to(torch.bool)
            pieces.append(self.layout.split(attention_mask, dim=1))
        return tuple(pieces)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float | None = None,
        where: str = "attention",
    ) -> torch.Tensor:
        """Exact attention of this rank's queries over every rank's keys: ``q`` [b, h, s/cp,
        d], ``k``, ``v`` [b, kv_heads, s/cp, d] -> [b, h, s/cp, d]. Communicates: see
        ``ring`` and ``all_to_all``."""
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        if self.key_valid is not None and self.key_valid.shape[1] != q.shape[2] * self.size:
            raise ValueError(
                f"{where}: the padding mask covers {self.key_valid.shape[1]} tokens but the "
                f"attention sees {q.shape[2]} x cp={self.size}: split the batch with "
                "ContextParallel.split before each forward"
            )
        if self.size == 1:
            from shardwise.parallel.context import blocks

            mask = blocks.allowed(
                self.layout.positions(q.shape[2], q.device),
                self.layout.positions(q.shape[2], q.device),
                causal,
                self.key_valid,
            )
            return blocks.attend(q, k, v, mask, scale)[0].to(q.dtype)
        if self.method == "ring":
            out: torch.Tensor = RingAttention.apply(
                q, k, v, self.group, self.layout, causal, scale, self.key_valid
            )
            return out
        return all_to_all_attention(
            q, k, v, self.group, self.layout, causal, scale, self.key_valid, where
        )

    def loss(self, local_sum: torch.Tensor, local_count: torch.Tensor | int) -> torch.Tensor:
        """The mean over every cp rank's tokens (``context_mean``)."""
        return context_mean(local_sum, local_count, self.group)


def context_mean(
    local_sum: torch.Tensor, local_count: torch.Tensor | int, group: Group
) -> torch.Tensor:
    """The mean of a per-token loss over every token of every cp rank of ``group``, from this
    rank's sum and count of counted tokens: the same value on every cp rank, and gradients such
    that the engine's average over the dp and cp ranks is the whole sequence's gradient.
    Communicates: one all_reduce of 16 bytes (sum and count)."""
    out: torch.Tensor = _ContextMean.apply(local_sum, torch.as_tensor(local_count), group)
    return out


class _ContextMean(torch.autograd.Function):
    """Forward: the sum over cp of ``local_sum`` divided by the total count (the same value on
    every cp rank). Backward: this rank's share, times cp: the engine averages gradients over
    the data-parallel and cp ranks together, which divides it back."""

    @staticmethod
    def forward(
        ctx: Any, local_sum: torch.Tensor, local_count: torch.Tensor, group: Group
    ) -> torch.Tensor:
        both = torch.stack([local_sum.detach().double(), local_count.double()])
        ops.all_reduce(both, "sum", group=group)
        if both[1] <= 0:
            raise ValueError("no token of the batch counts towards the loss on any cp rank")
        ctx.scale = group.size / float(both[1])
        return (both[0] / both[1]).to(local_sum.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad * ctx.scale, None, None
