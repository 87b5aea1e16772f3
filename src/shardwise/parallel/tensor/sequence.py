"""Column-parallel linear under sequence parallelism that keeps only the sequence shard.

Under sequence parallelism a column-parallel layer's input is all_gathered along the sequence
in forward. Autograd would save that full-sequence tensor for the weight gradient; instead this
function saves this rank's shard and all_gathers it again in backward (Korthikanti et al. 2022,
sec. 4.2.2), so every activation a block keeps is 1/tp of the single-process one. Column layers
reading one input (q, k, v) share one ``Regather``: one all_gather in backward for all of them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shardwise.comm.groups import Group
from shardwise.parallel.tensor import mappings


class Regather:
    """The full-sequence input, gathered again on first use in backward, dropped after the last
    of the ``pending`` layers that read it took it."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.pending = 0
        self._full: torch.Tensor | None = None

    def take(self, shard: torch.Tensor) -> torch.Tensor:
        """Communicates: all_gather of dim 1 (b·s·h elements) once per backward."""
        full = self._full
        if full is None:
            full = mappings.gather_dim(shard, mappings.SEQ_DIM, self.group)
        self.pending -= 1
        self._full = full if self.pending > 0 else None
        return full


class _ShardSavingLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        full: torch.Tensor,
        shard: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        regather: Regather,
    ) -> torch.Tensor:
        ctx.save_for_backward(shard, weight)
        ctx.regather, ctx.has_bias = regather, bias is not None
        regather.pending += 1
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shard, weight = ctx.saved_tensors
        grad_full = grad.matmul(weight)  # flows into the sequence gather: one reduce_scatter
        full = ctx.regather.take(shard)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_weight = g2.t().matmul(full.reshape(-1, full.shape[-1]))
        grad_bias = g2.sum(0) if ctx.has_bias else None
        return grad_full, None, grad_weight, grad_bias, None


def shard_saving_linear(
    full: torch.Tensor,
    shard: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    regather: Regather,
) -> torch.Tensor:
    """``F.linear(full, weight, bias)`` where ``full`` is ``shard`` gathered along the
    sequence; backward regathers ``shard`` instead of keeping ``full``."""
    return _ShardSavingLinear.apply(full, shard, weight, bias, regather)
