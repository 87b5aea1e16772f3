"""Fine-tuning on ranks through ``shardwise.initialize`` and a plain ``transformers`` loop in
one process on the same data order, for the equivalence tests."""

from __future__ import annotations

from pathlib import Path

import torch

import shardwise
from shardwise.sft.lora import LoraSpec, apply_lora, init_adapters
from shardwise.sft.model import build_model, check_model_dir, load_base_weights, load_tokenizer
from shardwise.sft.pipeline import load_training_data
from shardwise.sft.setup import build_finetune_model
from shardwise.sft.step import micro_losses
from shardwise.mesh import Axis, Mesh

LR = 1e-2  # large enough that the steps move the weights visibly


def engine_losses(
    model_dir: str,
    data_path: str,
    lora: str | None,
    *,
    packing: bool = False,
    zero: int = 3,
    tp: int = 1,
    steps: int = 4,
    micro: int = 2,
    accum: int = 2,
    seq_len: int = 48,
) -> list[float]:
    """The global token-mean loss of each step, shardwise on this world."""
    mesh = Mesh(dp=-1, tp=tp)
    tok = load_tokenizer(Path(model_dir))
    data = load_training_data(data_path, tok, seq_len=seq_len, packing=packing)
    spec = LoraSpec.parse(lora) if lora else None
    fm = build_finetune_model(Path(model_dir), mesh, lora=spec, seed=1)
    params = [p for p in fm.module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    cfg = shardwise.Config(
        zero_stage=zero,
        micro_batch_size=micro,
        gradient_accumulation_steps=accum,
        wrap_policy=fm.wrap_policy,
    )
    engine = shardwise.initialize(fm.parallelized, opt, cfg, **fm.initialize_kwargs())
    dp = mesh.group(Axis.DP)
    sampler = data.sampler(micro, dp.rank, dp.size, seed=5, grad_accum=accum)
    out = []
    for _ in range(steps):
        batches = [data.batch(sampler.next_batch()) for _ in range(accum)]
        local = micro_losses(engine, batches, dp, fm.attn_implementation)
        engine.step()
        mean = torch.tensor([sum(local) / len(local)], dtype=torch.float64)
        shardwise.comm.ops.all_reduce(mean, op="avg", group=dp)
        out.append(float(mean[0]))
    return out


def reference_losses(
    model_dir: str,
    data_path: str,
    lora: str | None,
    *,
    packing: bool = False,
    dp: int = 2,
    steps: int = 4,
    micro: int = 2,
    accum: int = 2,
    seq_len: int = 48,
) -> tuple[list[float], list[torch.Tensor]]:
    """The same run as one process with transformers' own loss (``labels=`` with
    ``num_items_in_batch``): each step's global batch, all micro-batches. Also returns the
    labels of the first step's micro-batches (the anchor's masking)."""
    tok = load_tokenizer(Path(model_dir))
    data = load_training_data(data_path, tok, seq_len=seq_len, packing=packing)
    model = build_model(check_model_dir(Path(model_dir)), 1)
    load_base_weights(model, Path(model_dir))
    if lora:
        model = apply_lora(model, LoraSpec.parse(lora))
        init_adapters(model, 1)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    sampler = data.sampler(micro, 0, 1, seed=5, grad_accum=dp * accum)
    losses, first_labels = [], []
    for step in range(steps):
        batches = [data.batch(sampler.next_batch()) for _ in range(dp * accum)]
        if step == 0:
            first_labels = [b.labels for b in batches]
        count = torch.tensor(sum(int((b.labels[:, 1:] != -100).sum()) for b in batches))
        total = 0.0
        for b in batches:
            loss = model(**b.model_inputs(), labels=b.labels, num_items_in_batch=count).loss
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, first_labels
