"""Cross-entropy over logits sharded along the vocabulary, without gathering them.

Each tp rank holds ``local_logits[..., chunk]`` for vocabulary ids
``[tp_rank * chunk, tp_rank * chunk + chunk)``; ids at or past ``vocab_size`` are padding and
take no part. Forward costs three all_reduces of one value per token (b·s elements each): the
max logit, the target logit, the sum of exponentials (Megatron-LM's vocab-parallel loss). With
label smoothing the second one also carries the sum of logits, so it is 2·b·s elements; the
smoothing term is then exact over the whole vocabulary. Backward is local: no communication.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.comm import ops
from shardwise.comm.groups import Group

REDUCTIONS = ("mean", "sum", "none")


def _check(local_logits: torch.Tensor, targets: torch.Tensor, smoothing: float) -> None:
    if not isinstance(local_logits, torch.Tensor) or not local_logits.is_floating_point():
        raise TypeError("local_logits must be a floating-point tensor [..., vocab // tp]")
    if tuple(targets.shape) != tuple(local_logits.shape[:-1]):
        raise ValueError(
            f"targets of shape {tuple(targets.shape)} do not match local_logits "
            f"{tuple(local_logits.shape)} without its last (vocabulary) dim"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 token ids, got {targets.dtype}")
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"label_smoothing={smoothing}: set it in [0, 1]")


class _VocabParallelCE(torch.autograd.Function):
    """Per-token loss [n] from local logits [n, chunk]; ignored tokens give 0."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: Group,
        vocab_size: int,
        ignore_index: int,
        smoothing: float,
    ) -> torch.Tensor:
        chunk = logits.shape[-1]
        start = group.rank * chunk
        real = max(0, min(chunk, vocab_size - start))  # real ids this rank holds
        x = logits.float()
        if real < chunk:
            x = x.clone()
            x[:, real:] = float("-inf")
        top = x.max(dim=-1).values if real > 0 else x.new_full((x.shape[0],), float("-inf"))
        ops.all_reduce(top, op="max", group=group)
        shifted = x - top.unsqueeze(1)
        valid = targets != ignore_index
        local_t = targets - start
        mine = valid & (local_t >= 0) & (local_t < real)
        idx = torch.where(mine, local_t, torch.zeros_like(local_t)).long()
        picked = torch.where(mine, shifted.gather(1, idx.unsqueeze(1)).squeeze(1), 0.0)
        parts = [picked]
        if smoothing > 0:
            parts.append(shifted[:, :real].sum(dim=-1))
        sums = torch.stack(parts)
        ops.all_reduce(sums, op="sum", group=group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        ops.all_reduce(sum_exp, op="sum", group=group)
        lse = sum_exp.log()  # log-sum-exp of the shifted logits
        loss = lse - sums[0]
        if smoothing > 0:
            loss = (1 - smoothing) * loss + smoothing * (lse - sums[1] / vocab_size)
        loss = torch.where(valid, loss, 0.0)
        ctx.save_for_backward(exp, sum_exp, idx, mine, valid)
        ctx.smoothing, ctx.real, ctx.vocab_size = smoothing, real, vocab_size
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        exp, sum_exp, idx, mine, valid = ctx.saved_tensors
        eps = ctx.smoothing
        g = exp / sum_exp.unsqueeze(1)  # softmax over the whole vocabulary, this rank's part
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows[mine], idx[mine]] -= 1.0 - eps
        if eps > 0:
            g[:, : ctx.real] -= eps / ctx.vocab_size
        g *= (grad * valid).unsqueeze(1)
        return g.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    targets: torch.Tensor,
    group: Group,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    *,
    vocab_size: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of vocab-sharded logits; equals ``F.cross_entropy`` on the gathered logits.

    Args:
        local_logits: ``[..., chunk]``, this tp rank's vocabulary columns
            ``[rank * chunk, (rank + 1) * chunk)``.
        targets: int64 ``[...]`` global token ids; ``ignore_index`` entries add nothing.
        group: the tp group the vocabulary is sharded over.
        ignore_index: target id that contributes no loss and no gradient.
        label_smoothing: as ``F.cross_entropy``: mixes in a uniform target over the vocabulary.
        vocab_size: the real vocabulary (default ``chunk * tp``); columns at or past it are
            padding and are excluded.
        reduction: ``"mean"`` over non-ignored targets, ``"sum"`` or ``"none"`` (per target).

    Communicates: 3 all_reduces of one element per target in forward (the second carries two
    per target when ``label_smoothing > 0``); none in backward.
    """
    _check(local_logits, targets, label_smoothing)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: choose one of {REDUCTIONS}")
    chunk = local_logits.shape[-1]
    vocab = chunk * group.size if vocab_size is None else vocab_size
    if not (chunk - 1) * group.size < vocab <= chunk * group.size:
        raise ValueError(
            f"vocab_size={vocab} does not fit {group.size} shards of {chunk} columns "
            f"(needs {(chunk - 1) * group.size + 1}..{chunk * group.size})"
        )
    flat_t = targets.reshape(-1)
    loss = _VocabParallelCE.apply(
        local_logits.reshape(-1, chunk), flat_t, group, vocab, ignore_index, label_smoothing
    )
    if reduction == "none":
        return loss.view(targets.shape).to(local_logits.dtype)
    total = loss.sum()
    if reduction == "sum":
        return total.to(local_logits.dtype)
    return (total / (flat_t != ignore_index).sum()).to(local_logits.dtype)
