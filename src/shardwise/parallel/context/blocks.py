"""Exact attention of some queries over one block of keys, and the log-sum-exp merge of blocks.

Ring attention sees the keys one block at a time, so it keeps each query's partial output and
the log of its softmax denominator (``lse``) and merges blocks with the online-softmax rule
(Milakov and Gimelshein 2018; Dao et al. 2022, FlashAttention, sec. 3.1). The backward of a
block needs only the final output and ``lse`` (FlashAttention, sec. B.2). Scores are computed in
fp32. A query that may see no key at all (every key masked) gets output 0 and ``lse = -inf``.
"""

from __future__ import annotations

from typing import Any

import torch


def repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[batch, kv_heads, seq, dim] -> [batch, heads, seq, dim]`` (grouped-query attention:
    each kv head serves ``heads / kv_heads`` query heads)."""
    kv_heads = t.shape[1]
    if kv_heads == heads:
        return t
    return t.repeat_interleave(heads // kv_heads, dim=1)


def fold_kv(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The adjoint of ``repeat_kv``: sum each kv head's query heads' gradients."""
    b, heads, s, d = t.shape
    if heads == kv_heads:
        return t
    return t.view(b, kv_heads, heads // kv_heads, s, d).sum(2)


def allowed(
    q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, key_valid: torch.Tensor | None
) -> torch.Tensor | None:
    """Which (query, key) pairs may attend: ``[batch or 1, 1, sq, sk]`` bool, or None for all.

    ``q_pos``, ``k_pos``: global positions; ``key_valid``: ``[batch, seq]`` bool over the whole
    sequence (False: padding), indexed by ``k_pos``."""
    mask = None
    if causal:
        mask = (q_pos[:, None] >= k_pos[None, :])[None, None]
    if key_valid is not None:
        pad = key_valid[:, k_pos][:, None, None, :]
        mask = pad if mask is None else mask & pad
    return mask


def _scores(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    s = torch.matmul(q.float(), repeat_kv(k, q.shape[1]).float().transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    # rows that see no key have lse = -inf: their probabilities are 0, not nan
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - safe[..., None])


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [b, h, sq, d] over ``k``, ``v`` [b, kv_heads, sk, d]: (output fp32
    [b, h, sq, d], lse fp32 [b, h, sq]). Differentiable (used whole by all-to-all)."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(_probs(s, lse), repeat_kv(v, q.shape[1]).float())
    return out, lse


def merge(
    out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions of the same queries over disjoint key blocks."""
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_a = torch.exp(lse - safe)[..., None]
    w_b = torch.exp(lse_b - safe)[..., None]
    return out * w_a + out_b * w_b, new


def block_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    lse: torch.Tensor,
    dout: torch.Tensor,
    delta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key block's share of the gradients (fp32): (dq [b, h, sq, d], dk, dv [b, kv_heads,
    sk, d]), given the merged ``lse``, the output gradient ``dout`` and ``delta`` = rowsum(dout *
    out) (FlashAttention, sec. B.2)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    p = _probs(_scores(q, k, mask, scale), lse)  # [b, h, sq, sk]
    kr, vr = repeat_kv(k, heads).float(), repeat_kv(v, heads).float()
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, vr.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(ds, kr) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq, fold_kv(dk, kv_heads), fold_kv(dv, kv_heads)


class WholeAttention(torch.autograd.Function):
    """``apply(q, k, v, q_pos, k_pos, causal, key_valid, scale) -> out`` fp32 [b, h, sq, d]:
    ``attend`` under the ``allowed`` mask of the positions, keeping for backward only what
    FlashAttention keeps (q, k, v and the log-sum-exp; the output and the probabilities are
    recomputed), never the [sq, sk] scores: activations stay linear in the sequence."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        causal: bool,
        key_valid: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        out, lse = attend(q, k, v, allowed(q_pos, k_pos, causal, key_valid), scale)
        ctx.save_for_backward(q, k, v, lse)
        ctx.meta = (q_pos, k_pos, causal, key_valid, scale)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, lse = ctx.saved_tensors
        q_pos, k_pos, causal, key_valid, scale = ctx.meta
        mask = allowed(q_pos, k_pos, causal, key_valid)
        out = torch.matmul(
            _probs(_scores(q, k, mask, scale), lse), repeat_kv(v, q.shape[1]).float()
        )
        dout = dout.float()
        delta = (dout * out).sum(-1)
        dq, dk, dv = block_grads(q, k, v, mask, scale, lse, dout, delta)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
