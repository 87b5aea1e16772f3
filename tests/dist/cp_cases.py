"""Rank-side bodies of the context-parallel tests (imported by the spawned ranks)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import shardwise
from shardwise.parallel.context import ContextParallel
from shardwise.parallel.context.blocks import repeat_kv

F32 = 4


def _qkv(batch: int, heads: int, kv_heads: int, seq: int, dim: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shapes = [(batch, heads, seq, dim), (batch, kv_heads, seq, dim), (batch, kv_heads, seq, dim)]
    return [torch.randn(s, generator=g) for s in shapes]


def right_padding(batch: int, seq: int) -> torch.Tensor:
    """[batch, seq] bool: row i has its last i * 3 tokens padded."""
    mask = torch.ones(batch, seq, dtype=torch.bool)
    for i in range(batch):
        if i:
            mask[i, seq - 3 * i :] = False
    return mask


def attention_vs_full(method: str, causal: bool, padded: bool, kv_heads: int) -> dict[str, int]:
    """cp attention's output and q/k/v gradients equal full attention's on one device."""
    mesh = shardwise.Mesh(cp=shardwise.world_size())
    cp_size = mesh.cp_size
    batch, heads, seq, dim = 2, 4, 8 * cp_size, 8
    full = [t.requires_grad_() for t in _qkv(batch, heads, kv_heads, seq, dim)]
    dout = torch.randn(batch, heads, seq, dim, generator=torch.Generator().manual_seed(3))
    valid = right_padding(batch, seq) if padded else None
    mask = None
    if causal:
        mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
    if valid is not None:
        pad = valid[:, None, None, :]
        mask = pad if mask is None else mask & pad
    q, k, v = full
    ref = F.scaled_dot_product_attention(
        q, repeat_kv(k, heads), repeat_kv(v, heads), attn_mask=mask
    )
    ref.backward(dout)
    cp = ContextParallel(mesh.group("cp"), method)
    if valid is not None:
        cp.key_valid = valid
    lay = cp.layout
    local = [lay.split(t.detach(), dim=2).requires_grad_() for t in full]
    mesh.stats.reset()
    out = cp.attention(*local, causal=causal)
    out.backward(lay.split(dout, dim=2))
    torch.testing.assert_close(out, lay.split(ref.detach(), dim=2), rtol=1e-5, atol=1e-6)
    for mine, whole in zip(local, full):
        assert whole.grad is not None and mine.grad is not None
        torch.testing.assert_close(mine.grad, lay.split(whole.grad, dim=2), rtol=1e-5, atol=1e-6)
    return {op: int(s["bytes"]) for op, s in mesh.stats.snapshot().items()}


def gpt_config(seq_len: int, n_head: int = 4):
    from shardwise.models.gpt import GPTConfig

    # no biases: the key projection's bias has a zero gradient in exact arithmetic (softmax
    # ignores a shift shared by all keys), so AdamW would turn rounding noise into updates
    return GPTConfig(
        vocab_size=37, seq_len=seq_len, n_layer=2, n_head=n_head, d_model=16, bias=False
    )


def lm_batches(steps: int, rows: int, seq: int, vocab: int = 37, pad: bool = True) -> list:
    """(ids, targets) per step; with ``pad`` each row's last 3 * (row % 3) targets are padding
    (-100)."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (rows, seq), generator=g)
        y = torch.randint(0, vocab, (rows, seq), generator=g)
        for i in range(rows):
            if pad and i % 3:
                y[i, seq - 3 * (i % 3) :] = -100
        out.append((x, y))
    return out


def gpt_reference(cfg, data: list, parts: int) -> tuple:
    """A seeded GPT, a copy trained in one process on ``data`` (AdamW, lr 1e-3; each step's
    loss the mean of ``parts`` row chunks' mean losses), and that run's losses."""
    import copy

    from shardwise.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses = []
    for x, y in data:
        loss = sum(ref(xs, ys) for xs, ys in zip(x.chunk(parts), y.chunk(parts))) / parts
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(float(loss.detach()))
    return model, ref, losses


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def gpt_cp_parity(
    dp: int,
    cp_size: int,
    stage: int,
    method: str,
    tp_size: int = 1,
    recompute: bool = False,
    steps: int = 5,
) -> dict:
    """dp x cp (x tp) GPT through parallelize + initialize vs one process: losses each step,
    every weight after ``steps`` AdamW steps (fp32, rtol 1e-5), and what cp sent."""

    from shardwise.parallel.plans import gpt as gpt_plans

    mesh = shardwise.Mesh(dp=dp, cp=cp_size, tp=tp_size)
    seq = 4 * mesh.world_size
    cfg = gpt_config(seq)
    data = lm_batches(steps, 2 * dp, seq)
    # each dp rank's mean over its tokens, averaged over dp
    model, ref, ref_losses = gpt_reference(cfg, data, dp)
    plan = gpt_plans.plan(cfg, mesh, cp_method=method, recompute=["Block"] if recompute else ())
    par = shardwise.parallelize(model, mesh, plan)
    assert par.context is not None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = shardwise.initialize(par, opt, shardwise.Config(zero_stage=stage))
    loss_of = gpt_plans.loss(cfg, mesh)
    me = mesh.rank("dp")
    sent: dict[str, int] = {}
    for step, (x, y) in enumerate(data):
        xs, ys = par.context.split(x.chunk(dp)[me], y.chunk(dp)[me])
        mesh.stats.reset()
        loss = loss_of(engine(xs), ys)
        engine.backward(loss)
        snap = mesh.stats.snapshot()
        sent = {op: int(snap[op]["bytes"]) for op in ("send", "all_to_all") if op in snap}
        engine.step()
        total = loss.detach() / dp
        shardwise.comm.all_reduce(total, group=mesh.group("dp"))
        _close(total, torch.tensor(ref_losses[step]), f"loss at step {step}")
    got, want = engine.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        _close(got[name], want[name], f"{name} after {steps} steps")
    return {"sent": sent, "losses": ref_losses}


def llama_cp_parity(cp_size: int, method: str, steps: int = 5) -> dict:
    """HF Llama (grouped-query attention, right-padded batch with an attention mask) at cp vs
    one process: losses each step and every weight after ``steps`` AdamW steps."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.parallel.plans import llama

    mesh = shardwise.Mesh(cp=cp_size)
    seq = 4 * mesh.world_size
    cfg = LlamaConfig(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    ref = copy.deepcopy(model)
    data = lm_batches(steps, 3, seq)
    masks = [(y != -100).long() for _, y in data]  # the padded tail is masked out too
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_losses = []
    for (x, y), m in zip(data, masks):
        logits = ref(input_ids=x, attention_mask=m).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss.detach()))
    plan = shardwise.ParallelPlan(context=llama.context_plan(method))
    par = shardwise.parallelize(model, mesh, plan)
    assert par.context is not None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = shardwise.initialize(par, opt, shardwise.Config(zero_stage=1))
    loss_of = llama.loss(mesh)
    for step, ((x, y), m) in enumerate(zip(data, masks)):
        xs, ys, ms = par.context.split(x, y, attention_mask=m)
        loss = loss_of(engine(input_ids=xs, attention_mask=ms).logits, ys)
        engine.backward(loss)
        engine.step()
        _close(loss.detach(), torch.tensor(ref_losses[step]), f"loss at step {step}")
    got, want = engine.state_dict(), ref.state_dict()
    for name in want:
        _close(got[name], want[name], f"{name} after {steps} steps")
    return {"losses": ref_losses}


def gpt_pp_cp_parity(method: str, stage: int, microbatches: int = 2, steps: int = 5) -> dict:
    """pp2 x cp2 GPT through ``plans.gpt.plan`` + initialize vs one process: losses each step
    and this stage's weights after ``steps`` AdamW steps (fp32, rtol 1e-5); returns the GPT
    names this stage compared."""

    from shardwise.parallel.plans import gpt as gpt_plans

    mesh = shardwise.Mesh(pp=2, cp=2)
    seq = 4 * mesh.world_size
    cfg = gpt_config(seq)
    data = lm_batches(steps, 2 * microbatches, seq)
    # the pipeline's loss: the mean of its micro-batches' means
    model, ref, ref_losses = gpt_reference(cfg, data, microbatches)
    par = shardwise.parallelize(model, mesh, gpt_plans.plan(cfg, mesh, cp_method=method))
    assert par.context is not None and par.pipeline is not None
    opt = torch.optim.AdamW(par.module.parameters(), lr=1e-3)
    config = shardwise.Config(zero_stage=stage, pipeline_microbatches=microbatches)
    engine = shardwise.initialize(par, opt, config)
    for step, (x, y) in enumerate(data):
        loss = engine.train_batch(*par.context.split(x, y))
        _close(loss.detach(), torch.tensor(ref_losses[step]), f"loss at step {step}")
    want = ref.state_dict()
    compared = []
    for name, got in engine.state_dict().items():
        if name in par.names:
            _close(got, want[par.names[name]], f"{name} after {steps} steps")
            compared.append(par.names[name])
    return {"compared": compared, "params": [n for n, _ in ref.named_parameters()]}


def unmatched_context_pattern_over_pp() -> str:
    """A context-plan pattern matching no layer on any pp stage is refused on every rank."""
    from shardwise.models.gpt import GPT
    from shardwise.parallel.parallelize import ContextPlan
    from shardwise.parallel.plans import gpt as gpt_plans

    mesh = shardwise.Mesh(pp=2, cp=2)
    cfg = gpt_config(4 * mesh.world_size)
    base = gpt_plans.plan(cfg, mesh)
    assert base.context is not None
    modules = {**base.context.modules, "layers.*.attn.nothing": "sdpa"}
    plan = dataclasses.replace(base, context=ContextPlan(modules, base.context.method))
    try:
        shardwise.parallelize(GPT(cfg), mesh, plan)
    except ValueError as exc:
        return str(exc)
    return "accepted"



def _saved_bytes(mesh: shardwise.Mesh, method: str, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes the GPT recipe's forward and loss save for backward on this rank of ``mesh``."""
    from shardwise.models.gpt import GPT
    from shardwise.parallel.plans import gpt as gpt_plans
    from shardwise.testing import SavedTensorBytes

    cfg = dataclasses.replace(gpt_config(x.shape[1]), vocab_size=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    par = shardwise.parallelize(model, mesh, gpt_plans.plan(cfg, mesh, cp_method=method))
    if par.context is not None:
        x, y = par.context.split(x, y)
    loss_of = gpt_plans.loss(cfg, mesh)
    saved = SavedTensorBytes(model)
    loss = saved.measure(lambda: loss_of(model(x), y))
    loss.backward()  # what was saved is what backward needs: it runs
    return saved.total


def saved_activation_bytes(method: str, batch: int = 2) -> dict:
    """Bytes saved for backward on this cp rank (its tokens of the batch) and, through the same
    recipe on a mesh without cp, on the whole batch."""
    world = shardwise.world_size()
    x, y = lm_batches(1, batch, 8 * world, 64, pad=False)[0]
    whole = _saved_bytes(shardwise.Mesh(dp=world), "ring", x, y)
    return {"cp_rank": _saved_bytes(shardwise.Mesh(cp=world), method, x, y), "whole": whole}
