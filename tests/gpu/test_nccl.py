"""The same checks on NCCL and CUDA tensors (world size 1); skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _nccl_task():
    import os

    import shardwise

    os.environ.update(
        {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29517",
        }
    )
    shardwise.init(backend="nccl")
    dev = shardwise.device()
    t = torch.arange(6.0, device=dev)
    shardwise.all_reduce(t, op="avg")
    assert torch.equal(t, torch.arange(6.0, device=dev))
    assert torch.equal(shardwise.all_gather(t), t)
    assert torch.equal(shardwise.reduce_scatter(t), t)
    from shardwise.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.named("tiny")).to(dev)
    engine = shardwise.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        shardwise.Config(zero_stage=3, precision="bf16"),
    )
    x = torch.randint(0, 256, (2, 65), device=dev)
    losses = []
    for _ in range(5):
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    shardwise.shutdown()


def test_nccl_collectives_and_engine():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_nccl_task)
    p.start()
    p.join(300)
    assert p.exitcode == 0
