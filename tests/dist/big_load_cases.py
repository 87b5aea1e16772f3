"""Rank functions for the deferred-initialization and streaming-load tests."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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


def llama_deferred_equals_eager(tie: bool) -> tuple[int, int]:
    from transformers import LlamaForCausalLM

    config = hf_models.tiny_llama(tie=tie).config
    torch.manual_seed(0)
    eager = LlamaForCausalLM(config).state_dict()
    torch.manual_seed(0)
    with shardwise.deferred_init():
        model = LlamaForCausalLM(config)
    torch.manual_seed(0)
    engine = shardwise.initialize(model, _sgd, shardwise.Config(zero_stage=3))
    got = engine.state_dict()
    assert set(got) == set(eager)
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
    engine = shardwise.initialize(meta, _sgd, shardwise.Config(zero_stage=stage), weights=model_dir)
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


def init_peak_against_costmodel(stage: int) -> dict[str, int]:
    """The measured init peaks of a meta-built and an eagerly built GPT, and the transient the
    deferred one held beside its state."""
    torch.manual_seed(0)
    with shardwise.deferred_init():
        meta = GPT(GPT_CFG)
    deferred = shardwise.initialize(meta, _sgd, shardwise.Config(zero_stage=stage))
    eager = shardwise.initialize(GPT(GPT_CFG), _sgd, shardwise.Config(zero_stage=stage))
    return {
        "deferred": deferred.memory()["init_peak"],
        "transient": deferred.init_peak.largest_transient,
        "eager": eager.memory()["init_peak"],
    }


class _HeldPeak(TorchDispatchMode):
    """The most bytes malloc hands out (``mallinfo2``: heap in use + mapped chunks), read after
    every tensor op inside the block; with ``_exact_malloc`` every tensor of 128 KiB or more is
    its own mapping, returned when freed, so the figure is what is held."""

    def __init__(self) -> None:
        super().__init__()
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"))
        self.libc.mallinfo2.restype = _MallInfo2
        self.start = self.peak = self.held()

    def held(self) -> int:
        info = self.libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.held())
        return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks")
        + ("uordblks", "fordblks", "keepcost")
    ]


PIPE_CFG = GPTConfig(vocab_size=512, seq_len=32, d_model=256, n_layer=4, n_head=4, dropout=0.0)


def pipeline_stage_allocation(pp: int, meta: bool) -> dict[str, int]:
    """The GPT recipe at pp (as ``train --pp``): the most this rank held while the model was
    built and split, against its own stage's bytes and the largest module's; and the stage's
    weights against the eagerly built GPT's under the same seed."""
    from limit_cases import _exact_malloc

    from shardwise.costmodel.memory import gpt_largest_unit_elements
    from shardwise.deferred import materialize_kept
    from shardwise.mesh import Mesh
    from shardwise.parallel import plans

    _exact_malloc()
    mesh = Mesh(pp=pp, dp=-1)
    with shardwise.deferred_init():  # warm up: what the first meta build loads, once
        tiny = GPT(GPT_CFG)
    materialize_kept(tiny, tiny)
    del tiny
    gc.collect()
    with _HeldPeak() as held:
        torch.manual_seed(0)
        with shardwise.deferred_init() if meta else contextlib.nullcontext():
            model = GPT(PIPE_CFG)
        par = shardwise.parallelize(model, mesh, plans.gpt.plan(PIPE_CFG, mesh))
        del model
    own = sum(p.nbytes for p in par.module.parameters())
    torch.manual_seed(0)
    eager = GPT(PIPE_CFG).state_dict()
    for name, p in par.module.named_parameters():
        assert torch.equal(p, eager[par.names[name]]), name
    return {
        "held": held.peak - held.start,
        "own": own,
        "largest": 4 * gpt_largest_unit_elements(PIPE_CFG),
        "params": len(list(par.module.parameters())),
        "whole": 4 * PIPE_CFG.param_count(),
    }
