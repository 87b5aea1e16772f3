"""Point-to-point messages between two ranks of a group (the all_reduce algorithms are built
from these; ``ops`` re-exports them as the library's ``send`` / ``recv``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm import crossing, emulate
from shardwise.comm.dispatch import Handle, check_group, check_tensor, launch, nbytes
from shardwise.comm.groups import Group
from shardwise.comm.signatures import Recv, Send, publish


def _send(
    t: torch.Tensor, dst: int, *, group: Group, async_op: bool = False
) -> Handle[None] | None:
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


def _recv(
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


send: Send = publish(_send, "send")
recv: Recv = publish(_recv, "recv")
