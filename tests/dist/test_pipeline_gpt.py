"""The built-in GPT split into pipeline stages, against the whole model in one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.plans.gpt import pipeline_layers
from shardwise.parallel.pipeline import PipelineExecutor, PipelineModule
from shardwise.testing import run_on_ranks

CFG = GPTConfig(vocab_size=17, seq_len=8, d_model=16, n_head=2, n_layer=3, dropout=0.0)
STEPS = 20


def gpt_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len), generator=g)
    return x, torch.randint(0, CFG.vocab_size, (8, CFG.seq_len), generator=g)


def _gpt_name(pipe_name: str) -> str:
    """``layers.{i}.x`` / ``tied.tok_emb.x`` -> the GPT's own parameter name."""
    n = CFG.n_layer
    if pipe_name.startswith("tied.tok_emb."):
        return "tok_emb." + pipe_name.split(".", 2)[2]
    _, idx, rest = pipe_name.split(".", 2)
    i = int(idx)
    if i == 1:
        return rest  # pos_emb.weight
    if i <= n + 1:
        return f"blocks.{i - 2}.{rest}"
    return f"ln_f.{rest}"


def _train_task(schedule: str, m: int) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = shardwise.Mesh(pp=shardwise.world_size(), dp=1)
    pipe = PipelineModule(pipeline_layers(model), gpt_loss, mesh, partition="parameters")
    run = PipelineExecutor(pipe, schedule, microbatches=m)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        losses.append(run.train_batch(*_batch(step)).item())
        opt.step()
    tied = {k: p.detach().clone() for k, p in pipe.tied.named_parameters()}
    return {
        "losses": losses,
        "params": pipe.stage_state_dict(),
        "tied": tied,
        "bounds": pipe.bounds,
    }


def test_gpt_pipeline_trains_like_the_whole_model() -> None:
    """pp=2, 1F1B, 20 steps: losses and weights match; tok_emb and head stay bitwise equal;
    every weight is saved exactly once. (SGD: the attention key bias has an exactly-zero
    gradient, whose rounding noise Adam would blow up to full-size steps.)"""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    want = dict(model.named_parameters())
    out = run_on_ranks(2, _train_task, "1f1b", 4)
    assert out[0]["bounds"] == out[1]["bounds"] and out[0]["bounds"][1] > 1
    assert torch.equal(out[0]["tied"]["tok_emb.weight"], out[1]["tied"]["tok_emb.weight"])
    saved = {}
    for r in range(2):
        assert out[r]["losses"] == pytest.approx(ref_losses, rel=1e-5)
        for k in out[r]["params"]:
            assert k not in saved, f"{k} saved twice"
        saved.update(out[r]["params"])
    assert sorted(_gpt_name(k) for k in saved) == sorted(want)
    for k, v in saved.items():
        torch.testing.assert_close(v, want[_gpt_name(k)].detach(), rtol=1e-5, atol=1e-6, msg=k)
