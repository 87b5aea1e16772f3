"""Rank functions for the Hugging Face round trips: a directory written by ``transformers``
``save_pretrained`` -> a model built on the meta device and streamed in at a layout -> three
AdamW steps beside ``transformers`` training in one process -> ``Engine.save_pretrained`` ->
``from_pretrained`` gives the engine's logits."""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import shardwise
from shardwise.comm import ops
from shardwise.mesh import Axis, Mesh
from shardwise.parallel import plans
from shardwise.parallel.parallelize import ParallelPlan, PipelineSplit
from shardwise.parallel.pipeline import LayerFn, Tied

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import hf_models  # noqa: E402

STEPS = 3
LR = 1e-3
WEIGHT_TOL = {"rtol": 1e-5, "atol": 1e-5}
"""Trained weights against the reference: GPT-2's key biases get no gradient but rounding
noise (~1e-10, the softmax ignores them), which AdamW turns into updates of about
lr * |g| / eps ~ 1e-5 * lr, different for each summation order; 1e-5 absolute is 1% of lr."""
SHARD = "20KB"  # several output files
GPT2_VOCAB = 95
"""Odd: under tp2 the vocabulary-split embedding and its tied head are padded."""
VOCABS = {"llama": hf_models.VOCAB, "gpt2": GPT2_VOCAB}
TP_PLANS = {"llama": plans.llama.tp_plan, "gpt2": plans.gpt2.tp_plan}


def source_model(kind: str):  # -> the transformers model the directory is saved from
    """The tiny Llama or GPT-2 (seed 0), dropout off so training is deterministic."""
    if kind == "llama":
        return hf_models.tiny_llama(seed=0)
    model = hf_models.tiny_gpt2(seed=0, vocab=GPT2_VOCAB)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        setattr(model.config, key, 0.0)
    torch.manual_seed(0)
    return type(model)(model.config).eval()


def write_source(kind: str, path: str) -> None:
    hf_models.save(source_model(kind), Path(path), max_shard_size=SHARD)


def tokens(step: int, kind: str = "llama") -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCABS[kind], (4, 9), generator=g)


def _adamw(params):  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=LR)


def reference(kind: str, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``transformers`` training in this process: each step the mean of the dp chunks'
    losses (the gradient of the whole batch's mean loss); the losses and trained weights."""
    model = source_model(kind).train()
    opt = _adamw(model.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(model(c, labels=c).loss for c in tokens(step, kind).chunk(dp)) / dp
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: t.detach().clone() for n, t in model.state_dict().items()}


# -- pipelines of the two models (stages of decoder blocks; tied GPT-2 head) ---------------


def llama_layers(model) -> list:  # type: ignore[no-untyped-def]
    inner = model.model

    def decoder(layer, h: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        pos = torch.arange(h.shape[1]).unsqueeze(0)
        out = layer.block(h, position_embeddings=layer.rotary(h, pos), position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    return [
        LayerFn(lambda layer, ids: layer.emb(ids), emb=inner.embed_tokens),
        *(LayerFn(decoder, block=b, rotary=inner.rotary_emb) for b in inner.layers),
        LayerFn(lambda layer, h: layer.head(layer.norm(h)), norm=inner.norm, head=model.lm_head),
    ]


def gpt2_layers(model) -> list:  # type: ignore[no-untyped-def]
    """Token embedding and head are one tied module (the model ties them)."""
    inner = model.transformer

    def positions(layer, h: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return h + layer.wpe(torch.arange(h.shape[1]).unsqueeze(0))

    def block(layer, h: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        out = layer.block(h)
        return out[0] if isinstance(out, tuple) else out

    return [
        Tied("wte", inner.wte),
        LayerFn(positions, wpe=inner.wpe),
        *(LayerFn(block, block=b) for b in inner.h),
        LayerFn(lambda layer, h: layer.ln(h), ln=inner.ln_f),
        Tied("wte", inner.wte, forward_fn=lambda emb, h: h @ emb.weight.t()),
    ]


def _shifted_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


LAYERS: dict[str, Callable] = {"llama": llama_layers, "gpt2": gpt2_layers}


# -- the engine at each layout --------------------------------------------------------------


def _meta(kind: str):  # type: ignore[no-untyped-def]
    config = source_model(kind).config
    with shardwise.deferred_init():
        return type(source_model(kind))(config)


def build(kind: str, layout: str, model_dir: str):  # type: ignore[no-untyped-def]
    """The engine over a meta-built ``kind`` streamed from ``model_dir`` at ``layout``:
    ``one`` (one process), ``dp2_zero3``, ``dp2_tp2`` (ZeRO-3 over dp; the model type's
    tensor-parallel plan) or ``pp2``."""
    meta = _meta(kind)
    if layout in ("one", "dp2_zero3"):
        cfg = shardwise.Config(zero_stage=0 if layout == "one" else 3)
        return shardwise.initialize(meta, _adamw, cfg, weights=model_dir)
    if layout == "dp2_tp2":
        mesh = Mesh(dp=2, tp=2)
        par = shardwise.parallelize(meta, mesh, ParallelPlan(tensor=TP_PLANS[kind]()))
        return shardwise.initialize(par, _adamw, shardwise.Config(zero_stage=3), weights=model_dir)
    assert layout == "pp2", layout
    mesh = Mesh(pp=2, dp=1)
    split = PipelineSplit(LAYERS[kind], _shifted_loss, "uniform")
    # the stages stay on the meta device: the weights stream into ZeRO's pieces
    par = shardwise.parallelize(meta, mesh, ParallelPlan(pipeline=split), keep_meta=True)
    cfg = shardwise.Config(zero_stage=0, pipeline_microbatches=2)
    return shardwise.initialize(par, _adamw, cfg, weights=model_dir)


def _dp(engine) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    mesh = engine.mesh
    if mesh is None:
        return engine.dp_group.rank, engine.dp_group.size
    return mesh.rank(Axis.DP), mesh.dp_size


def _train_step(engine, step: int, pipelined: bool, kind: str = "llama") -> float:  # type: ignore[no-untyped-def]
    me, dp = _dp(engine)
    x = tokens(step, kind).chunk(dp)[me]
    if pipelined:  # targets shifted by hand, as the model's own loss shifts them
        return float(engine.train_batch(x[:, :-1], x[:, 1:]))
    engine.train()
    loss = engine(x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


def _pipeline_logits(engine, x: torch.Tensor, width: int) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
    """Stage 0's output sent to stage 1, whose output is the logits (returned there)."""
    pipe, pp = engine.module, engine.mesh.group(Axis.PP)
    with torch.no_grad():
        if pipe.pp_rank == 0:
            h = pipe.forward_stage(0, x)
            ops.send(h.contiguous(), pp.ranks[1], group=pp)
            return None
        h = torch.empty(x.shape[0], x.shape[1], width)
        ops.recv(h, pp.ranks[0], group=pp)
        return pipe.forward_stage(1, h)


def _logits(engine, x: torch.Tensor, width: int) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
    """The engine's model's logits for ``x`` (a pipeline: on its last stage only)."""
    if engine.mesh is not None and engine.mesh.pp_size > 1:
        return _pipeline_logits(engine, x, width)
    engine.eval()
    with torch.no_grad():
        return engine(x).logits


def _plain_state(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The engine's whole weights under the plain model's names (a pipeline: this stage's)."""
    state = engine.state_dict()
    rename = getattr(engine.module, "plain_names", None)
    return {rename[n]: t for n, t in state.items()} if rename else state


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], **tol: float) -> int:
    """Every tensor of ``got`` equals ``want``'s within ``tol``; how many were compared."""
    for name, value in got.items():
        torch.testing.assert_close(
            value.float(), want[name].float(), msg=lambda m, n=name: f"{n}: {m}", **tol
        )
    return len(got)


def round_trip(kind: str, layout: str, model_dir: str, out: str) -> dict:
    """The whole chain on this rank (see the module docstring); returns this rank's losses
    and what it compared."""
    engine = build(kind, layout, model_dir)
    source = source_model(kind)
    width = source.config.hidden_size
    loaded = _close(_plain_state(engine), source.state_dict(), rtol=0, atol=1e-6)
    _, dp = _dp(engine)
    want_losses, trained = reference(kind, dp)
    losses = [_train_step(engine, s, layout == "pp2", kind) for s in range(STEPS)]
    _close(_plain_state(engine), trained, **WEIGHT_TOL)
    x = tokens(STEPS, kind)
    logits = _logits(engine, x, width)
    engine.save_pretrained(out, SHARD, config=source.config)
    world = shardwise.comm.resolve(None)
    if logits is not None:  # every rank that has the logits reloads and compares
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(out).float().eval()
        with torch.no_grad():
            torch.testing.assert_close(reloaded(x).logits, logits, rtol=0, atol=1e-6)
        _close(reloaded.state_dict(), trained, **WEIGHT_TOL)
    shardwise.comm.barrier(group=world)
    return {"losses": losses, "want": want_losses, "loaded": loaded, "logits": logits is not None}


def save_trained(kind: str, layout: str, model_dir: str, root: str) -> list[float]:
    """``STEPS - 1`` steps at ``layout``, then a checkpoint in ``root``; this rank's losses."""
    engine = build(kind, layout, model_dir)
    losses = [_train_step(engine, s, False, kind) for s in range(STEPS - 1)]
    engine.save(root)
    return losses


def load_and_finish(kind: str, layout: str, model_dir: str, root: str) -> dict:
    """A fresh engine at ``layout`` loads the checkpoint and takes the last step: its weights
    (and optimizer moments) came back whole when it ends at the reference's weights."""
    engine = build(kind, layout, model_dir)
    engine.load(root)
    assert engine.global_step == STEPS - 1
    loss = _train_step(engine, STEPS - 1, False, kind)
    _, trained = reference(kind, 2)  # the checkpoint's steps ran at dp2
    _close(_plain_state(engine), trained, **WEIGHT_TOL)
    return {"loss": loss, "dp": _dp(engine)[1]}


def lora_round_trip(model_dir: str, out: str, stage: int) -> dict:
    """A LoRA Llama over a base streamed from ``model_dir`` at dp over every rank (ZeRO
    ``stage``), as ``shardwise finetune`` builds it: two steps, the adapter saved alone, then
    ``PeftModel.from_pretrained`` over the directory's base gives the engine's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardwise.sft.base_weights import base_name, open_base_weights
    from shardwise.sft.lora import LoraSpec, adapter_init_fn, apply_lora
    from shardwise.sft.setup import check_base_weights

    meta = _meta("llama")
    check_base_weights(meta, Path(model_dir))  # every base tensor is there: strict on the base
    model = apply_lora(meta, LoraSpec.parse("r=4,alpha=8,dropout=0.0,targets=q_proj,v_proj"))
    engine = shardwise.initialize(
        model,
        _adamw,
        shardwise.Config(zero_stage=stage),
        weights=open_base_weights(Path(model_dir), model),
        init_fn=adapter_init_fn(model, seed=0),
        strict=False,  # the adapters are not in the directory: init_fn makes them
    )
    source = source_model("llama").state_dict()
    state = engine.state_dict()
    base = {base_name(n): t for n, t in state.items() if "lora_" not in n}
    loaded = _close(base, source, rtol=0, atol=1e-6)
    assert loaded == len(source)
    losses = [_train_step(engine, s, False) for s in range(2)]
    trained = engine.state_dict()
    lora_b = [t for n, t in trained.items() if "lora_B" in n]
    assert lora_b and all(bool(t.abs().sum() > 0) for t in lora_b)  # the adapters learned
    for n, t in trained.items():  # the frozen base did not move
        if "lora_" not in n:
            torch.testing.assert_close(t, state[n], rtol=0, atol=0)
    x = tokens(STEPS)
    logits = _logits(engine, x, 0)
    report = engine.save_pretrained(out, adapter_only=True)
    world = shardwise.comm.resolve(None)
    if world.rank == 0:
        base_model = AutoModelForCausalLM.from_pretrained(model_dir)
        reloaded = PeftModel.from_pretrained(base_model, out).eval()
        with torch.no_grad():
            torch.testing.assert_close(reloaded(x).logits, logits, rtol=0, atol=1e-6)
    shardwise.comm.barrier(group=world)
    return {"losses": losses, "adapter": report.tensors, "files": sorted(os.listdir(out))}
