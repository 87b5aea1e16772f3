"""Train your own nn.Module with shardwise: a small MLP learns y = sin(x) on synthetic data.

shardwise run --nproc-per-node 2 examples/train_custom.py
torchrun --nproc-per-node 2 examples/train_custom.py
"""

import logging

import torch
from torch import nn

import shardwise

shardwise.init()
logging.basicConfig(level=logging.INFO, format=f"[rank {shardwise.rank()}] %(message)s")
torch.manual_seed(0)  # the same model everywhere (the engine also takes rank 0's weights)
model = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
config = shardwise.Config(zero_stage=2, gradient_accumulation_steps=2, gradient_clipping=1.0)
engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), config)

data = torch.Generator().manual_seed(1 + shardwise.rank())  # each rank draws its own batches
while engine.global_step < 200:  # optimizer steps; 2 micro-batches each
    x = torch.rand(64, 1, generator=data) * 6.28 - 3.14
    loss = nn.functional.mse_loss(engine(x), torch.sin(x))
    engine.backward(loss)
    if engine.step() and engine.global_step % 50 == 0 and shardwise.rank() == 0:
        logging.info("step %d: loss %.4f", engine.global_step, loss.item())
shardwise.shutdown()
