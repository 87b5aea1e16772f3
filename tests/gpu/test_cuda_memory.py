"""Model-state bytes on a CUDA device equal the engine's report and the ZeRO formulas (one
rank: every stage holds everything); skipped without a CUDA device."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _memory_task(stage: int, precision: str, port: int, out: mp.Queue) -> None:
    import os

    import shardwise
    from shardwise.models import GPT, GPTConfig

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    shardwise.init(backend="nccl")
    dev = shardwise.device()
    torch.manual_seed(0)
    model = GPT(GPTConfig.named("small")).to(dev)
    n = sum(p.numel() for p in model.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    engine = shardwise.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        shardwise.Config(zero_stage=stage, precision=precision),
    )
    x = torch.randint(0, 256, (2, 129), device=dev)
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()
    torch.cuda.synchronize()
    out.put((n, engine.memory(), torch.cuda.memory_allocated(dev) - before))
    shardwise.shutdown()


@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (3, "fp32"), (3, "bf16")])
def test_model_state_bytes_on_cuda(stage: int, precision: str) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_memory_task, args=(stage, precision, 29530 + stage, out))
    p.start()
    n, report, allocated = out.get(timeout=300)
    p.join(60)
    assert p.exitcode == 0
    # after a step, per parameter: stage 0 fp32 params 4 + grads 4 + Adam 8; stage 3 frees the
    # gradients after the step: fp32 params 4 + Adam 8; bf16 params 2 + fp32 master 4 + Adam 8
    per = {(0, "fp32"): 16, (3, "fp32"): 12, (3, "bf16"): 14}[(stage, precision)]
    held = report["device"]
    assert held == pytest.approx(per * n, rel=0.01)  # padding to the world size only
    # what CUDA holds after a step: the model states, and nothing left over from backward
    # beyond the allocator's rounding (the activations are freed)
    assert allocated == pytest.approx(held, rel=0.05), (allocated, held)
