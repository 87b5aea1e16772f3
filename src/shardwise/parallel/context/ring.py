"""Ring attention: exact attention over a sequence split across the cp ranks.

Each rank keeps its queries; the key/value blocks travel around the cp ring (rank r sends to
r + 1 and receives from r - 1), and each rank merges its partial attention over every block
with the log-sum-exp rule (``blocks.merge``). The next block's transfer is posted before the
current block is computed, so it overlaps the compute (Liu et al. 2023, sec. 3).

Backward passes the key/value blocks around the ring again; each block's gradient accumulator
starts on the rank after its owner and follows the block, arriving home after the last step.

Communicates per call and rank, with K and V this rank's [b, kv_heads, s / cp, d] pieces:
forward (cp - 1) sends and receives of K and V stacked, i.e. (cp - 1)/cp of the whole K and V;
backward (cp - 1) of K and V again and (cp - 1) of their gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.comm import ops
from shardwise.comm.dispatch import Handle
from shardwise.comm.groups import Group
from shardwise.parallel.context import blocks
from shardwise.parallel.context.layout import SequenceLayout


class _Ring:
    """This rank's neighbours on the cp ring and its exchanges with them."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.size, self.rank = group.size, group.rank
        self.next = group.ranks[(self.rank + 1) % self.size]
        self.prev = group.ranks[(self.rank - 1) % self.size]

    def shift(self, t: torch.Tensor) -> tuple[Handle[None], Handle[torch.Tensor]]:
        """Post sending ``t`` to the next rank and receiving the previous rank's into a new
        buffer (the two complete together: ``wait`` on both)."""
        sent = ops.send(t, self.next, group=self.group, async_op=True)
        got = ops.recv(torch.empty_like(t), self.prev, group=self.group, async_op=True)
        return sent, got


class RingAttention(torch.autograd.Function):
    """``apply(q, k, v, group, layout, causal, scale, key_valid) -> out`` [b, h, s/cp, d].

    ``q`` [b, h, s/cp, d], ``k``, ``v`` [b, kv_heads, s/cp, d]: this rank's tokens in the
    ``layout``'s order; ``key_valid``: [b, s] bool over the whole sequence, or None."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: Group,
        layout: SequenceLayout,
        causal: bool,
        scale: float,
        key_valid: torch.Tensor | None,
    ) -> torch.Tensor:
        ring = _Ring(group)
        local = q.shape[2]
        q_pos = layout.positions(local, q.device)
        kv = torch.stack([k, v]).contiguous()  # [2, b, kv_heads, s/cp, d]: one message a step
        out: torch.Tensor | None = None
        lse = torch.empty(0)
        for j in range(ring.size):
            pending = ring.shift(kv) if j < ring.size - 1 else None
            k_pos = layout.positions_of((ring.rank - j) % ring.size, local, q.device)
            mask = blocks.allowed(q_pos, k_pos, causal, key_valid)
            o_j, lse_j = blocks.attend(q, kv[0], kv[1], mask, scale)
            out, lse = (o_j, lse_j) if out is None else blocks.merge(out, lse, o_j, lse_j)
            if pending is not None:
                pending[0].wait()
                kv = pending[1].wait()
        assert out is not None
        # stored as [b, s/cp, h, d], the model's layout after attention: its transpose back is
        # a view, so the output projection's saved input is this same tensor
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (group, layout, causal, scale, key_valid)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, layout, causal, scale, key_valid = ctx.meta
        ring = _Ring(group)
        local = q.shape[2]
        q_pos = layout.positions(local, q.device)
        dout = dout.float()
        delta = (dout * out).sum(-1)  # [b, h, s/cp]

        def grads(kv: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
            k_pos = layout.positions_of((ring.rank - j) % ring.size, local, q.device)
            mask = blocks.allowed(q_pos, k_pos, causal, key_valid)
            dq_j, dk_j, dv_j = blocks.block_grads(q, kv[0], kv[1], mask, scale, lse, dout, delta)
            return dq_j, torch.stack([dk_j, dv_j])

        kv = torch.stack([k, v]).contiguous()
        dq, own = grads(kv, 0)
        # message order on each link (what the receiver posts, in the same order): the first
        # block, then per step j >= 1 the block forwarded (j < cp - 1) after the accumulator
        # of step j - 1 (j >= 2); last, the accumulator that comes home
        pending = ring.shift(kv) if ring.size > 1 else None
        sends: list[Handle[None]] = []
        for j in range(1, ring.size):
            assert pending is not None
            sends.append(pending[0])
            kv = pending[1].wait()
            acc_in = None
            if j >= 2:
                acc_in = ops.recv(torch.empty_like(own), ring.prev, group=group, async_op=True)
            pending = ring.shift(kv) if j < ring.size - 1 else None
            acc = acc_in.wait() if acc_in is not None else torch.zeros_like(own)
            dq_j, dkv_j = grads(kv, j)
            dq += dq_j
            acc += dkv_j
            sends.append(ops.send(acc, ring.next, group=group, async_op=True))
        if ring.size > 1:
            own += ops.recv(torch.empty_like(own), ring.prev, group=group)
        for s in sends:
            s.wait()
        return (
            dq.to(q.dtype),
            own[0].to(k.dtype),
            own[1].to(v.dtype),
            None,
            None,
            None,
            None,
            None,
        )
