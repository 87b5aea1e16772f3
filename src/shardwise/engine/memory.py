"""What an engine holds in memory on this rank, counted from the tensors that exist."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.zero import optimizer as zero_opt
from shardwise.zero.flat_param import FlatParam

KINDS = ("params", "grads", "optimizer", "buffers", "comm")


def memory_report(
    module: nn.Module,
    flats: list[FlatParam],
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    host: torch.device,
    comm_bytes: int,
) -> dict[str, int]:
    """Bytes this rank holds now: params, grads, optimizer (states and a separate fp32
    master), buffers, comm (``comm_bytes``: buffers of collectives in flight); plus ``device``
    and ``host`` totals (``host``: where optimizer states live). A tensor-parallel layer's
    parameters count at their local (sharded) size."""
    params = grads = master = master_host = 0
    for f in flats:
        m = f.memory()
        params += m["params"]
        grads += m["grads"]
        master += m["master"]
        if f.master.device.type == "cpu" and device.type != "cpu":
            master_host += m["master"]
    inside = {id(p) for f in flats for p in f.params}
    for p in module.parameters():
        if id(p) not in inside:
            params += p.untyped_storage().nbytes()
    states = zero_opt.state_bytes(optimizer)
    opt_host = states if host.type == "cpu" and device.type != "cpu" else 0
    out = {
        "params": params,
        "grads": grads,
        "optimizer": states + master,
        "buffers": sum(b.untyped_storage().nbytes() for b in module.buffers()),
        "comm": comm_bytes,
    }
    out["host"] = opt_host + master_host
    out["device"] = sum(out[k] for k in KINDS) - out["host"]
    return out
