"""Hello from every rank: mesh coordinates and one all_reduce.

shardwise run --nproc-per-node 2 examples/hello.py
torchrun --nproc-per-node 2 examples/hello.py
"""

import logging

import torch

import shardwise

logging.basicConfig(level=logging.INFO, format="%(message)s")
log = logging.getLogger("hello")

shardwise.init()
mesh = shardwise.Mesh(dp=shardwise.world_size())
value = torch.tensor([float(shardwise.rank() + 1)])
total = shardwise.all_reduce(value.clone(), op="sum", group=mesh.group("dp"))
expected = shardwise.world_size() * (shardwise.world_size() + 1) / 2
log.info(
    "rank %d/%d coords %s device %s: all_reduce(rank+1) = %g (expected %g)",
    shardwise.rank(),
    shardwise.world_size(),
    mesh.coords,
    shardwise.device(),
    total.item(),
    expected,
)
assert total.item() == expected
shardwise.shutdown()
