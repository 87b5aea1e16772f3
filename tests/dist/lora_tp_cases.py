"""Rank-side body of the LoRA-under-tp test: a peft LoRA Llama split over tp trains like its
unsplit copy in the same task (every trainable gradient checked against the matching slice of
the reference's, every step)."""

from __future__ import annotations

import copy

import torch
import tp_cases as tc

from shardwise.mesh import Mesh
from shardwise.parallel import plans
from shardwise.parallel import tensor as swtp

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def lora_llama(vocab: int, dropout: float = 0.0) -> torch.nn.Module:
    """A tiny Llama with LoRA on every linear; B drawn at random (not peft's zero), so A's
    gradient is not zero from the first step."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=dropout)
    model = get_peft_model(tc.llama_model(vocab), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.2)
    return model


def lora_parity(tp_size: int, vocab: int, sp: bool, steps: int = 4) -> list[float]:
    mesh = Mesh(dp=-1, tp=tp_size)
    model = lora_llama(vocab)
    ref = copy.deepcopy(model)
    plan = {f"base_model.model.{k}": v for k, v in plans.llama.tp_plan().items()}
    tp = swtp.parallelize(model, mesh, plan, sequence_parallel=sp)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ref_params = dict(ref.named_parameters())
    opt = torch.optim.AdamW([p for _, p in trained], lr=1e-2)
    ref_opt = torch.optim.AdamW([ref_params[n] for n, _ in trained], lr=1e-2)
    losses = []
    for step, (x, y) in enumerate(tc.batches(steps, vocab)):
        ref_loss = tc._llama_loss(ref, x, y)
        ref_loss.backward()
        loss = tc._llama_loss(model, x, y)
        loss.backward()
        tc._close(loss.detach(), ref_loss.detach(), f"loss at step {step}")
        for name, p in trained:
            want = tp.placements[name].shard_of(ref_params[name].grad)
            tc._close(p.grad, want, f"grad of {name} at step {step}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    tc.check_full_state(tp, ref, steps)
    return losses


def replicas_with_dropout(tp_size: int, sp: bool, steps: int = 3) -> dict:
    """LoRA dropout on under tp: the replicated factors after ``steps`` steps, and the first
    forward's dropout masks of column-parallel layers (q: the same input on every tp rank; gate:
    under SP this rank's tokens) and of a row-parallel one (its input: this rank's features)."""
    mesh = Mesh(dp=-1, tp=tp_size)
    model = lora_llama(37, dropout=0.5)
    plan = {f"base_model.model.{k}": v for k, v in plans.llama.tp_plan().items()}
    tp = swtp.parallelize(model, mesh, plan, sequence_parallel=sp)
    masks: dict[str, torch.Tensor] = {}
    layer = "base_model.model.model.layers.0"

    def keep(proj: str):  # a forward hook that records its first output's zeros
        def hook(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
            masks.setdefault(proj, out == 0)

        return hook

    for proj in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj"):
        module = model.get_submodule(f"{layer}.{proj}.lora_dropout.default")
        module.register_forward_hook(keep(proj.rsplit(".", 1)[-1]))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2)
    model.train()
    for x, y in tc.batches(steps, 37):
        tc._llama_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    replicated = {
        n: p.detach()
        for n, p in model.named_parameters()
        if p.requires_grad and not tp.placements[n].shards
    }
    return {"replicated": replicated, "masks": masks}
