"""gloo's missing pieces, built from point-to-point messages.

gloo's ring all_gather slows down on large messages and its reduce_scatter runs a full
all_reduce internally; a direct exchange with isend/irecv does neither. ``ops`` picks these
paths on gloo; results and counted bytes are the same as the collective's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm import crossing
from shardwise.comm.dispatch import Handle, launch, nbytes
from shardwise.comm.groups import Group

P2P_TAG = 0x5357  # gloo slots for point-to-point collectives (apart from user send/recv)
P2P_ALL_GATHER_MIN_BYTES = 4 << 20  # below this, gloo's own all_gather is as fast


def finish_avg(t: torch.Tensor, op: str, size: int) -> torch.Tensor:
    """``avg`` on gloo is a sum then a division by the group size."""
    if op == "avg" and size > 1:
        t.div_(size)
    return t


def combine(op: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = op(a, b)`` elementwise for the reduce ops (avg sums; ``out`` may be ``a``)."""
    if op in ("sum", "avg"):
        torch.add(a, b, out=out)
    elif op == "max":
        torch.maximum(a, b, out=out)
    else:
        torch.minimum(a, b, out=out)


def all_gather(
    g: Group, src: torch.Tensor, out: torch.Tensor, async_op: bool, t: torch.Tensor
) -> torch.Tensor | Handle[torch.Tensor]:
    """all_gather from isend/irecv straight into ``out``'s chunks."""
    me = g.rank
    parts = out.chunk(g.size)

    def issue() -> list[Any]:
        works = []
        for j in range(g.size):
            if j != me:
                works.append(dist.isend(src, g.ranks[j], group=g.pg, tag=P2P_TAG + 1))
                works.append(dist.irecv(parts[j], g.ranks[j], group=g.pg, tag=P2P_TAG + 1))
        return works

    def finish() -> torch.Tensor:
        if parts[me].data_ptr() != src.data_ptr():
            parts[me].copy_(src)
        return out

    far = crossing.all_gather(g, nbytes(out))
    return launch("all_gather", g, [t], nbytes(out), issue, finish, async_op, inter_node_bytes=far)


def reduce_scatter(
    g: Group,
    op: str,
    chunks: list[torch.Tensor],
    out: torch.Tensor,
    async_op: bool,
    src: torch.Tensor,
) -> torch.Tensor | Handle[torch.Tensor]:
    """reduce_scatter from isend/irecv: chunk j goes to group rank j, and each rank combines
    what it receives in group-rank order. (N-1)/N of the tensor leaves each rank, half of what
    an all_reduce moves."""
    me = g.rank
    # Two ranks: the peer's chunk can land straight in ``out`` (one add, no extra buffer)
    # unless ``out`` is this rank's own chunk of the input.
    direct = (
        g.size == 2
        and out.data_ptr() != chunks[me].data_ptr()
        and out.is_contiguous()
        and op in ("sum", "avg")
    )
    received = {
        j: (out if direct else torch.empty_like(chunks[me])) for j in range(g.size) if j != me
    }

    def issue() -> list[Any]:
        works = []
        for j in range(g.size):
            if j != me:
                works.append(dist.isend(chunks[j], g.ranks[j], group=g.pg, tag=P2P_TAG))
                works.append(dist.irecv(received[j], g.ranks[j], group=g.pg, tag=P2P_TAG))
        return works

    def finish() -> torch.Tensor:
        # group-rank order, accumulated in ``out`` (which may alias this rank's chunk: the
        # first elementwise op reads it before writing)
        if direct:  # a + b == b + a exactly: the same result as the general order
            out.add_(chunks[me])
            return finish_avg(out, op, g.size)
        parts = [chunks[me] if j == me else received[j] for j in range(g.size)]
        # accumulating into ``out`` is safe unless it aliases a part read after the first op
        late_alias = me >= 2 and out.data_ptr() == chunks[me].data_ptr()
        acc = torch.empty_like(out) if late_alias else out
        combine(op, parts[0], parts[1], acc)
        for part in parts[2:]:
            combine(op, acc, part, acc)
        if acc is not out:
            out.copy_(acc)
        return finish_avg(out, op, g.size)

    far = crossing.reduce_scatter(g, chunks)
    extra = f"op={op}, "
    return launch(
        "reduce_scatter",
        g,
        [src],
        nbytes(src),
        issue,
        finish,
        async_op,
        extra,
        inter_node_bytes=far,
    )
