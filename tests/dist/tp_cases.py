"""Rank-side bodies of the tensor-parallel tests: each builds its own mesh and computes its
single-process reference in the same task (same seed, a deep copy of the model before it is
split), then checks this rank's shards against the matching slices of the reference."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from shardwise.parallel import tensor as swtp
from shardwise.comm import comm_stats
from shardwise.mesh import Mesh
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel import plans
from shardwise.parallel.plans.gpt import tp_plan
from shardwise.recompute import apply_activation_checkpointing

RTOL, ATOL = 1e-5, 1e-6
BATCH, SEQ = 2, 8


def gpt_config(vocab: int = 37, n_layer: int = 2, dropout: float = 0.0) -> GPTConfig:
    return GPTConfig(
        vocab_size=vocab, seq_len=SEQ, n_layer=n_layer, n_head=4, d_model=16, dropout=dropout
    )


def batches(steps: int, vocab: int, ignore: bool = True, seed: int = 1) -> list:
    """The same global batches on every rank; some targets are ignore_index (-100)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
        y = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
        if ignore:
            y[torch.rand(y.shape, generator=gen) < 0.25] = -100
        out.append((x, y))
    return out


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _check_grads(tp: swtp.TensorParallel, ref: torch.nn.Module) -> None:
    ref_params = dict(ref.named_parameters())
    for name, p in tp.model.named_parameters():
        placement = tp.placements[name]
        _close(p.grad, placement.shard_of(ref_params[name].grad), f"grad of {name}")
        if placement.padded:  # the padding rows never get a gradient
            real = placement.real_box()[1][0]
            assert not p.grad.narrow(0, real, p.shape[0] - real).any()


def train_pair(model, ref, tp, data, loss_fn, steps_checked_grads=1):
    """Train ``ref`` (one process) and the tp ``model`` on ``data`` with AdamW; compare.

    eps=1e-6: the key bias's gradient is exactly zero in exact arithmetic (softmax ignores a
    per-row constant), so both runs see rounding noise of ~1e-11 there, which the default
    eps=1e-8 would blow up to lr-sized steps of random sign."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    losses = []
    for step, (x, y) in enumerate(data):
        ref_loss = loss_fn(ref, x, y)
        ref_loss.backward()
        loss = loss_fn(model, x, y)
        loss.backward()
        _close(loss.detach(), ref_loss.detach(), f"loss at step {step}")
        if step < steps_checked_grads:
            _check_grads(tp, ref)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append(loss.item())
    check_full_state(tp, ref, len(data))
    return losses


def check_full_state(tp: swtp.TensorParallel, ref: torch.nn.Module, steps: int) -> None:
    """The tp model's full state dict equals the reference's after ``steps`` steps."""
    full, want = tp.full_state_dict(), ref.state_dict()
    assert full.keys() == want.keys()
    for k in want:
        assert full[k].shape == want[k].shape, k  # the padding does not show
        _close(full[k], want[k], f"{k} after {steps} steps")


def _gpt_loss(model, x, y):
    return model(x, y)


def gpt_parity(tp_size: int, sp: bool, vocab: int, steps: int = 5) -> list[float]:
    mesh = Mesh(dp=-1, tp=tp_size)
    torch.manual_seed(0)
    model = GPT(gpt_config(vocab))
    ref = copy.deepcopy(model)
    x0, _ = batches(1, vocab)[0]
    ref_logits = ref(x0)
    tp = swtp.parallelize(model, mesh, tp_plan(), sequence_parallel=sp)
    logits = model(x0)  # [batch, seq, chunk]: this rank's vocabulary columns
    chunk = logits.shape[-1]
    start, stop = min(mesh.rank("tp") * chunk, vocab), min((mesh.rank("tp") + 1) * chunk, vocab)
    _close(logits[..., : stop - start], ref_logits[..., start:stop], "local logits")
    return train_pair(model, ref, tp, batches(steps, vocab), _gpt_loss)


def llama_model(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    return LlamaForCausalLM(cfg).float()


def _llama_loss(model, x, y):
    return model(input_ids=x, labels=y).loss


def llama_parity(tp_size: int, vocab: int, sp: bool = False, steps: int = 5) -> list[float]:
    mesh = Mesh(dp=-1, tp=tp_size)
    torch.manual_seed(0)
    model = llama_model(vocab)
    ref = copy.deepcopy(model)
    x0, _ = batches(1, vocab)[0]
    ref_logits = ref(input_ids=x0).logits
    tp = swtp.parallelize(model, mesh, plans.llama.tp_plan(), sequence_parallel=sp)
    _close(model(input_ids=x0).logits, ref_logits, "logits")  # lm_head gathers its output
    return train_pair(model, ref, tp, batches(steps, vocab), _llama_loss)


def llama_norm_before_entry() -> None:
    """A plan whose 'sequence' module runs before its 'sequence_entry' fails in forward, naming
    both, instead of treating a whole-sequence gradient as a 1/tp part."""
    mesh = Mesh(dp=-1, tp=2)
    torch.manual_seed(0)
    model = llama_model(37)
    plan = dict(plans.llama.tp_plan())
    del plan["model.layers.0"]
    plan["model.layers.1"] = "sequence_entry"  # layer 0's norms now run before the entry
    swtp.parallelize(model, mesh, plan, sequence_parallel=True)
    x, _ = batches(1, 37)[0]
    _expect(RuntimeError, ["'model.layers.0.input_layernorm'", "'model.layers.1'"], model, x)


def ce_parity(tp_size: int, vocab: int, smoothing: float, ignore: bool) -> dict:
    mesh = Mesh(dp=-1, tp=tp_size)
    group = mesh.group("tp")
    gen = torch.Generator().manual_seed(3)
    full = (3 * torch.randn(BATCH, SEQ, vocab, generator=gen)).requires_grad_()
    _, y = batches(1, vocab, ignore=ignore)[0]
    want = F.cross_entropy(full.view(-1, vocab), y.view(-1), label_smoothing=smoothing)
    want.backward()
    chunk = -(-vocab // tp_size)
    start = min(mesh.rank("tp") * chunk, vocab)
    stop = min(start + chunk, vocab)
    local = full.detach().new_zeros(BATCH, SEQ, chunk)  # padding columns hold junk-free zeros
    local[..., : stop - start] = full.detach()[..., start:stop]
    local.requires_grad_()
    comm_stats(reset=True)
    got = swtp.vocab_parallel_cross_entropy(
        local, y, group, label_smoothing=smoothing, vocab_size=vocab
    )
    fwd = comm_stats(reset=True)
    got.backward()
    bwd = comm_stats(reset=True)
    _close(got.detach(), want.detach(), "loss")
    _close(local.grad[..., : stop - start], full.grad[..., start:stop], "grad of local logits")
    assert not local.grad[..., stop - start :].any(), "padding columns got a gradient"
    return {"fwd": fwd, "bwd": bwd}


def comm_counts(tp_size: int, sp: bool, n_layer: int) -> dict:
    mesh = Mesh(dp=-1, tp=tp_size)
    torch.manual_seed(0)
    model = GPT(gpt_config(vocab=40, n_layer=n_layer))
    tp = swtp.parallelize(model, mesh, tp_plan(), sequence_parallel=sp)
    x, y = batches(1, 40, ignore=False)[0]
    comm_stats(reset=True)
    loss = model(x, y)
    fwd = comm_stats(reset=True)
    loss.backward()
    bwd = comm_stats(reset=True)
    partial = [p.numel() for p in tp.partial_params()]
    return {"fwd": fwd, "bwd": bwd, "partial": partial}


def _grads_after_step(tp_size: int, sp: bool, recompute: bool, dropout: float) -> dict:
    mesh = Mesh(dp=-1, tp=tp_size)
    torch.manual_seed(0)
    model = GPT(gpt_config(n_layer=2, dropout=dropout))
    swtp.parallelize(model, mesh, tp_plan(), sequence_parallel=sp)
    if recompute:
        apply_activation_checkpointing(model, ["Block"])
    losses = []
    for x, y in batches(2, 37):
        loss = model(x, y)
        loss.backward()
        losses.append(loss.detach())
    return {"losses": losses, **{n: p.grad for n, p in model.named_parameters()}}


def recompute_bitwise(tp_size: int, sp: bool) -> None:
    off = _grads_after_step(tp_size, sp, recompute=False, dropout=0.2)
    on = _grads_after_step(tp_size, sp, recompute=True, dropout=0.2)
    for k in off:
        a, b = off[k], on[k]
        same = all(map(torch.equal, a, b)) if isinstance(a, list) else torch.equal(a, b)
        assert same, f"{k} differs between recompute on and off"


def dropout_masks(tp_size: int, sp: bool) -> torch.Tensor:
    """The mask the first block's residual dropout drew on this rank."""
    mesh = Mesh(dp=-1, tp=tp_size)
    torch.manual_seed(0)
    model = GPT(gpt_config(dropout=0.5))
    tp = swtp.parallelize(model, mesh, tp_plan(), sequence_parallel=sp)
    masks = []
    model.blocks[0].drop.register_forward_hook(lambda m, a, out: masks.append(out == 0))
    x, _ = batches(1, 37)[0]
    model(x)
    with tp.sharded_rng():  # e.g. attention dropout on this rank's heads
        local = torch.rand(16)
    return {"mask": masks[0], "sharded": local, "replicated": torch.rand(16)}


def replicas_after_steps(tp_size: int, steps: int) -> dict:
    """Replicated parameters after ``steps`` AdamW steps with SP and dropout on."""
    mesh = Mesh(dp=-1, tp=tp_size)
    torch.manual_seed(0)
    model = GPT(gpt_config(dropout=0.1))
    tp = swtp.parallelize(model, mesh, tp_plan(), sequence_parallel=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in batches(steps, 37):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in tp.model.named_parameters() if not tp.placements[n].shards}


def _expect(exc: type, words: list[str], fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc as e:
        msg = str(e)
        missing = [w for w in words if w not in msg]
        assert not missing, f"message {msg!r} lacks {missing}"
        return msg
    raise AssertionError(f"{fn.__name__} did not raise {exc.__name__} ({words})")


def bad_plans(tp_size: int) -> None:
    """Every bad plan fails at parallelize, naming the module, and leaves the model whole."""
    mesh = Mesh(dp=-1, tp=tp_size)
    torch.manual_seed(0)
    model = GPT(gpt_config(vocab=37))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = tp_plan()
    _expect(
        ValueError,
        ["'blocks.*.attn.qkv'"],
        swtp.parallelize,
        model,
        mesh,
        {**plan, "blocks.*.attn.qkv": "colwise"},
    )
    _expect(
        TypeError,
        ["'blocks.0.ln_attn'", "nn.Linear"],
        swtp.parallelize,
        model,
        mesh,
        {"blocks.*.ln_attn": "rowwise"},
    )
    _expect(
        TypeError,
        ["'blocks.0.attn.q_proj'", "nn.Embedding"],
        swtp.parallelize,
        model,
        mesh,
        {"blocks.0.attn.q_proj": "vocab_embedding"},
    )
    _expect(
        ValueError,
        ["'blocks.0.mlp.fc_in'", "'colwise'", "'rowwise'"],
        swtp.parallelize,
        model,
        mesh,
        {"blocks.*.mlp.*": "rowwise", "blocks.0.mlp.fc_in": "colwise"},
    )
    _expect(
        ValueError,
        ["'blocks.0.attn.q_proj'", "colwize"],
        swtp.parallelize,
        model,
        mesh,
        {"blocks.0.attn.q_proj": "colwize"},
    )
    _expect(
        ValueError,
        ["'ln_f.weight'", "'sequence'"],
        swtp.parallelize,
        model,
        mesh,
        {k: v for k, v in plan.items() if k != "ln_f"},
        sequence_parallel=True,
    )
    # the head is tied to the token embedding: splitting it by its input features conflicts
    _expect(
        ValueError,
        ["'tok_emb.weight'", "'head'"],
        swtp.parallelize,
        model,
        mesh,
        {**plan, "head": "rowwise"},
    )
    odd = torch.nn.ModuleDict({"up": torch.nn.Linear(4, 6), "down": torch.nn.Linear(6, 4)})
    _expect(
        ValueError,
        ["'up'", "out_features=6", f"tp={tp_size}"],
        swtp.parallelize,
        odd,
        mesh,
        {"up": "colwise", "down": "rowwise"},
    )
    _expect(
        ValueError, ["'down'", "in_features=6"], swtp.parallelize, odd, mesh, {"down": "rowwise"}
    )
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"a failed parallelize changed {k}"


def _ref_steps(ref, data, clip, loss_of=_gpt_loss):
    """One process on the global batches: losses, gradient norms (before clipping), state."""
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    losses, norms = [], []
    for x, y in data:
        loss = loss_of(ref, x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def engine_parity(
    dp: int,
    tp_size: int,
    stage: int,
    sp: bool,
    recompute: bool = False,
    precision: str = "fp32",
    offload: bool = False,
    kind: str = "gpt",
) -> dict:
    """dp x tp through ``shardwise.initialize`` (ZeRO over dp) vs one process, clipping active.
    Under bf16 the losses are compared at a bf16 tolerance and the weights not at all.
    ``kind``: the built-in GPT, or ``"llama"`` (a tiny HF LlamaForCausalLM)."""
    import shardwise

    mesh = Mesh(dp=dp, tp=tp_size)
    torch.manual_seed(0)
    if kind == "llama":
        model, loss_of, plan = llama_model(37), _llama_loss, plans.llama.tp_plan()
    else:
        model, loss_of, plan = GPT(gpt_config(vocab=37)), _gpt_loss, tp_plan()
    ref = copy.deepcopy(model)
    data = [
        (torch.cat([b[0] for b in bs]), torch.cat([b[1] for b in bs]))
        for bs in zip(*(batches(5, 37, ignore=False, seed=s) for s in range(dp)))
    ]
    clip = 0.05
    ref_losses, ref_norms = _ref_steps(ref, data, clip, loss_of)
    assert all(n > clip for n in ref_norms), "clipping must be active"
    tp = swtp.parallelize(model, mesh, plan, sequence_parallel=sp)
    cfg = shardwise.Config(
        zero_stage=stage,
        gradient_clipping=clip,
        reduce_bucket_bytes=4096,
        activation_checkpointing=["Block"] if recompute else None,
        precision=precision,
        offload_optimizer=offload,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    engine = shardwise.initialize(model, opt, cfg, group=mesh, placements=tp.placements)
    me = mesh.rank("dp")
    memory: dict[str, int] = {}
    for step, (x, y) in enumerate(data):
        loss = loss_of(engine, x.chunk(dp)[me], y.chunk(dp)[me])
        engine.backward(loss)
        memory = engine.memory()  # gradients held: the step's peak of model states
        engine.step()
        total = loss.detach().float() / dp
        shardwise.comm.all_reduce(total, group=mesh.group("dp"))
        if precision != "fp32":
            torch.testing.assert_close(total, torch.tensor(ref_losses[step]), rtol=2e-2, atol=0)
            continue
        _close(total, torch.tensor(ref_losses[step]), f"loss at step {step}")
        _close(torch.tensor(engine.grad_norm), torch.tensor(ref_norms[step]), f"norm {step}")
    if precision != "fp32":
        return {"losses": ref_losses, "memory": memory}
    want = ref.state_dict()
    got = engine.state_dict()  # the single-process model again, padding gone
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape, name
        _close(got[name], want[name], f"full {name} after {len(data)} steps")
    return {"losses": ref_losses, "memory": memory}


def block_activation_bytes(tp_size: int, sp: bool) -> int:
    """Bytes one GPT block saves for backward on this rank (storages other than parameters,
    each counted once); ``tp_size=1``: the plain single-process block."""
    from torch.autograd.graph import saved_tensors_hooks

    cfg = GPTConfig(vocab_size=64, seq_len=32, n_layer=1, n_head=4, d_model=32, dropout=0.1)
    torch.manual_seed(0)
    model = GPT(cfg)
    if tp_size > 1:
        swtp.parallelize(model, Mesh(dp=-1, tp=tp_size), tp_plan(), sequence_parallel=sp)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    seq = cfg.seq_len // tp_size if sp else cfg.seq_len
    x = torch.randn(4, seq, cfg.d_model, requires_grad=True)
    with saved_tensors_hooks(pack, lambda t: t):
        model.blocks[0](x)
    return sum(seen.values())


class TPMix(torch.nn.Module):
    """A residual MLP block whose two linears tensor parallelism splits."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def _tied_head(emb: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h @ emb.weight.t()


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def pipeline_stage_tp(n_blocks: int = 4, seed: int = 1234) -> float:
    """pp=2 x tp=2: each pipeline stage is tensor-parallel through the same ``parallelize``."""
    from shardwise.parallel.pipeline import LayerSpec, PipelineExecutor, PipelineModule, Tied

    vocab, dim = 11, 8
    emb = LayerSpec(torch.nn.Embedding, vocab, dim)
    blocks = [LayerSpec(TPMix, dim) for _ in range(n_blocks)]
    entries = [Tied("embed", emb), *blocks, Tied("embed", emb, forward_fn=_tied_head)]
    ref_emb = emb.build(seed)
    ref_blocks = [b.build(seed + i + 1) for i, b in enumerate(blocks)]
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, vocab, (4, 3), generator=gen) for _ in range(2))
    h = ref_emb(x)
    for b in ref_blocks:
        h = b(h)
    ref_loss = _lm_loss(_tied_head(ref_emb, h), y)
    ref_loss.backward()

    mesh = Mesh(pp=2, dp=1, tp=2)
    pipe = PipelineModule(entries, _lm_loss, mesh, "uniform", seed=seed)
    tp = swtp.parallelize(pipe, mesh, {"layers.*.up": "colwise", "layers.*.down": "rowwise"})
    loss = PipelineExecutor(pipe, "1f1b", microbatches=2).train_batch(x, y)
    _close(loss.detach(), ref_loss.detach(), "pipeline loss")
    checked = 0
    for name, p in pipe.layers.named_parameters():
        index, rest = name.split(".", 1)
        ref_p = dict(ref_blocks[int(index) - 1].named_parameters())[rest]
        _close(p.grad, tp.placements[f"layers.{name}"].shard_of(ref_p.grad), f"grad of {name}")
        checked += int(bool(tp.placements[f"layers.{name}"].shards))
    assert checked > 0, "this stage holds tensor-parallel layers"
    for p in pipe.tied.parameters():
        _close(p.grad, ref_emb.weight.grad, "tied embedding grad")
    return loss.item()
