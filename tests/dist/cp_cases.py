"""Rank-side bodies of the context-parallel tests (imported by the spawned ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardwise
from shardwise.parallel.context import ContextParallel
from shardwise.parallel.context.blocks import repeat_kv

F32 = 4


def _qkv(batch: int, heads: int, kv_heads: int, seq: int, dim: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shapes = [(batch, heads, seq, dim), (batch, kv_heads, seq, dim), (batch, kv_heads, seq, dim)]
    return [torch.randn(s, generator=g) for s in shapes]


def right_padding(batch: int, seq: int) -> torch.Tensor:
    """[batch, seq] bool: row i has its last i * 3 tokens padded."""
    mask = torch.ones(batch, seq, dtype=torch.bool)
    for i in range(batch):
        if i:
            mask[i, seq - 3 * i :] = False
    return mask


def attention_vs_full(method: str, causal: bool, padded: bool, kv_heads: int) -> dict[str, int]:
    """cp attention's output and q/k/v gradients equal full attention's on one device."""
    mesh = shardwise.Mesh(cp=shardwise.world_size())
    cp_size = mesh.cp_size
    batch, heads, seq, dim = 2, 4, 8 * cp_size, 8
    full = [t.requires_grad_() for t in _qkv(batch, heads, kv_heads, seq, dim)]
    dout = torch.randn(batch, heads, seq, dim, generator=torch.Generator().manual_seed(3))
    valid = right_padding(batch, seq) if padded else None
    mask = None
    if causal:
        mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
    if valid is not None:
        pad = valid[:, None, None, :]
        mask = pad if mask is None else mask & pad
    q, k, v = full
    ref = F.scaled_dot_product_attention(
        q, repeat_kv(k, heads), repeat_kv(v, heads), attn_mask=mask
    )
    ref.backward(dout)
    cp = ContextParallel(mesh.group("cp"), method)
    if valid is not None:
        cp.key_valid = valid
    lay = cp.layout
    local = [lay.split(t.detach(), dim=2).requires_grad_() for t in full]
    mesh.stats.reset()
    out = cp.attention(*local, causal=causal)
    out.backward(lay.split(dout, dim=2))
    torch.testing.assert_close(out, lay.split(ref.detach(), dim=2), rtol=1e-5, atol=1e-6)
    for mine, whole in zip(local, full):
        assert whole.grad is not None and mine.grad is not None
        torch.testing.assert_close(mine.grad, lay.split(whole.grad, dim=2), rtol=1e-5, atol=1e-6)
    return {op: int(s["bytes"]) for op, s in mesh.stats.snapshot().items()}
