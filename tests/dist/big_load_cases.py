"""Rank functions for the deferred-initialization and streaming-load tests."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import shardwise
from shardwise.hf import WeightsError
from shardwise.models.gpt import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import hf_models  # noqa: E402
import roundtrip_cases as rc  # noqa: E402

GPT_CFG = GPTConfig(vocab_size=50, seq_len=16, d_model=32, n_layer=2, n_head=4)


def _sgd(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.1)


def bound_holds(engine: shardwise.Engine) -> tuple[int, int]:
    """(init peak, bound): the final state held after initialize plus the largest local
    tensor at fp32 (the most a read or a module holds beside it), plus 10%."""
    mem = engine.memory()
    final = mem["params"] + mem["grads"] + mem["optimizer"] + mem["buffers"]
    largest = max(p.numel() for p in engine.module.parameters()) * 4
    return mem["init_peak"], int((final + largest) * 1.1)


def gpt_deferred_equals_eager(stage: int) -> tuple[int, int]:
    torch.manual_seed(0)
    eager = GPT(GPT_CFG).state_dict()
    torch.manual_seed(0)
    with shardwise.deferred_init():
        model = GPT(GPT_CFG)
    torch.manual_seed(0)
    engine = shardwise.initialize(model, _sgd, shardwise.Config(zero_stage=stage))
    got = engine.state_dict()
    for name, value in eager.items():
        assert torch.equal(got[name], value), name
    return bound_holds(engine)


def _batch(rank: int, world: int) -> torch.Tensor:
    x = torch.randint(0, hf_models.VOCAB, (4, 9), generator=torch.Generator().manual_seed(5))
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per]


def llama_load_train(model_dir: str, stage: int) -> tuple[list[float], tuple[int, int]]:
    rank, size = shardwise.rank(), shardwise.world_size()
    source = hf_models.tiny_llama(seed=0)
    from transformers import LlamaForCausalLM

    with shardwise.deferred_init():
        meta = LlamaForCausalLM(source.config)
    engine = shardwise.initialize(
        meta, _sgd, shardwise.Config(zero_stage=stage), weights=model_dir
    )
    state = engine.state_dict()
    for name, value in source.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)
    losses = []
    ref_opt = _sgd(source.parameters())
    source.train()
    engine.train()
    for _ in range(3):
        x = _batch(rank, size)
        loss = engine(x, labels=x).loss
        engine.backward(loss)
        engine.step()
        full = _batch(0, 1)
        ref_opt.zero_grad()
        ref = sum(source(c, labels=c).loss for c in full.chunk(size)) / size
        ref.backward()
        ref_opt.step()
        losses.append((float(loss), float(ref)))
    return losses, bound_holds(engine)


def bad_source(model_dir: str, layout: str = "dp2_zero3") -> str:
    """Start a meta-built Llama from a damaged ``model_dir`` at ``layout`` (see
    ``roundtrip_cases.build``): the error this rank raised (nothing was trained)."""
    try:
        rc.build("llama", layout, model_dir)
    except WeightsError as exc:
        return str(exc)
    raise AssertionError("a damaged source was accepted")


class _Bare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.lin = nn.Linear(4, 4)


def uninitialized_meta_param() -> str:
    with shardwise.deferred_init():
        model = _Bare()
    try:
        shardwise.initialize(model, _sgd, shardwise.Config(zero_stage=3))
    except ValueError as exc:
        return str(exc)
    raise AssertionError("a parameter nobody initialized was accepted")
