"""Picklable Python objects over a group: each is a length exchange, then the bytes."""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm import ops
from shardwise.comm.dispatch import check_group
from shardwise.comm.groups import Group


def _object_tensor(obj: Any) -> torch.Tensor:
    data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _device(g: Group) -> torch.device:
    """Where the bytes travel: the current CUDA device on nccl, else the CPU."""
    if g.pg is not None and dist.get_backend(g.pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(obj: Any, src: int = 0, *, group: Group) -> Any:
    """Pickle ``obj`` on world rank ``src`` and return it on every rank of the group.

    Communicates: two broadcasts (length, bytes)."""
    g = check_group(group, "broadcast_object")
    dev = _device(g)
    is_src = g.ranks[g.rank] == src
    payload = _object_tensor(obj).to(dev) if is_src else None
    length = torch.tensor([payload.numel() if payload is not None else 0], device=dev)
    ops.broadcast(length, src=src, group=g)
    if payload is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=dev)
    ops.broadcast(payload, src=src, group=g)
    return obj if is_src else pickle.loads(payload.cpu().numpy().tobytes())


def all_gather_object(obj: Any, *, group: Group) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order.

    Communicates: two all_gathers (lengths, bytes padded to the longest)."""
    g = check_group(group, "all_gather_object")
    dev = _device(g)
    payload = _object_tensor(obj).to(dev)
    lengths = ops.all_gather(torch.tensor([payload.numel()], device=dev), group=g).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=dev)
    padded[: payload.numel()] = payload
    full = ops.all_gather(padded.unsqueeze(0), group=g).cpu()
    return [pickle.loads(full[i, : lengths[i]].numpy().tobytes()) for i in range(g.size)]
