"""Rank functions for the Hugging Face export tests: an engine over a tiny HF model (built from
a config, nothing downloaded) writes a model directory that ``from_pretrained`` loads."""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import torch
import torch.nn.functional as F

import shardwise
from shardwise.mesh import Axis, Mesh
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel import plans
from shardwise.parallel.parallelize import ParallelPlan, PipelineSplit
from shardwise.parallel.pipeline import LayerFn
from shardwise.parallel.tensor import parallelize as tp_parallelize

VOCAB = 37  # does not divide by tp: the embedding and head carry vocabulary padding
SHARD = 12_000  # bytes per output file: several files
TARGETS = ("q_proj", "v_proj")


def hf_model(kind: str):  # -> a transformers causal LM
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=16)
        return GPT2LMHeadModel(cfg).float().eval()
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).float().eval()


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


def _reloaded_logits(out: Path, x: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        return model(x).logits


def _one_step(engine, x: torch.Tensor) -> None:
    engine.train()
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    engine.eval()


def _check(engine, out: Path, want: torch.Tensor, x: torch.Tensor, **options) -> dict:
    """Export (every rank), then rank 0 reloads and compares logits; the held-bytes bound."""
    report = engine.save_pretrained(out, SHARD, **options)
    world = shardwise.comm.resolve(None)
    result = {"peak": report.peak_held_bytes, "tensors": report.tensors}
    if world.rank == 0:
        got = _reloaded_logits(out, x)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        files = sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors")
        result["files"] = files
        result["largest_file"] = max((out / f).stat().st_size for f in files)
    shardwise.comm.barrier(group=world)
    return result


def export_dp(kind: str, stage: int, out: str, replicas: int = 1) -> dict:
    """Data parallel over every rank at ZeRO ``stage`` (``replicas`` > 1: hierarchical
    sharding, shards in groups of world / replicas), after one step."""
    model = hf_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    group = Mesh(dp=-1, dp_replicate=replicas) if replicas > 1 else None
    engine = shardwise.initialize(model, opt, shardwise.Config(zero_stage=stage), group=group)
    x = _tokens()
    _one_step(engine, x)
    with torch.no_grad():
        want = engine(x).logits
    return _check(engine, Path(out), want, x)


def export_dp_tp(stage: int, out: str) -> dict:
    """dp2 x tp2 over a Llama (vocabulary padded on the tp ranks), after one step."""
    mesh = Mesh(dp=2, tp=2)
    model = hf_model("llama")
    tp = tp_parallelize(model, mesh, plans.llama.tp_plan())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = shardwise.Config(zero_stage=stage)
    engine = shardwise.initialize(model, opt, cfg, group=mesh, placements=tp.placements)
    x = _tokens()
    _one_step(engine, x)
    with torch.no_grad():
        want = engine(x).logits
    return _check(engine, Path(out), want, x)


def llama_pipeline_layers(model) -> list:
    """A Llama as pipeline layers: embedding, each decoder layer (rotary positions and the
    causal mask made inside), then norm and head."""
    inner = model.model

    def embed(layer, ids: torch.Tensor) -> torch.Tensor:
        return layer.emb(ids)

    def decoder(layer, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1]).unsqueeze(0)
        out = layer.block(h, position_embeddings=layer.rotary(h, pos), position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    def head(layer, h: torch.Tensor) -> torch.Tensor:
        return layer.head(layer.norm(h))

    return [
        LayerFn(embed, emb=inner.embed_tokens),
        *(LayerFn(decoder, block=b, rotary=inner.rotary_emb) for b in inner.layers),
        LayerFn(head, norm=inner.norm, head=model.lm_head),
    ]


def _llama_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def export_pp(stage: int, out: str) -> dict:
    """pp2 (x dp over the rest) over a Llama split into pipeline layers, after one step of
    the pipeline engine; the reference takes the same step in one process."""
    mesh = Mesh(pp=2, dp=-1)
    model = hf_model("llama")
    ref = copy.deepcopy(model).train()
    split = PipelineSplit(llama_pipeline_layers, _llama_loss, "uniform")
    par = shardwise.parallelize(model, mesh, ParallelPlan(pipeline=split))
    del model
    opt = torch.optim.SGD(par.module.parameters(), lr=0.5)
    cfg = shardwise.Config(zero_stage=stage, pipeline_microbatches=2)
    engine = shardwise.initialize(par, opt, cfg)
    x = _tokens()
    dp, me = mesh.dp_size, mesh.rank(Axis.DP)
    xs = torch.cat([x] * dp)
    engine.train_batch(xs.chunk(dp)[me], xs.chunk(dp)[me])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    _llama_loss(ref(x).logits, x).backward()
    ref_opt.step()
    with torch.no_grad():
        want = ref.eval()(x).logits
    # a pipeline is not the HF model: its config comes from the caller
    return _check(engine, Path(out), want, x, config=ref.config)


def live_parameter_bytes(exclude: set[int]) -> int:
    """Bytes of every live ``nn.Parameter``'s storage (each storage once), leaving out the
    parameters whose ids are in ``exclude`` (alive before the test began)."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.nn.Parameter) and id(obj) not in exclude:
            s = obj.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def stage_only_bytes(pp: int, tp: int) -> dict:
    """The GPT recipe at pp (x tp): after the caller drops the GPT, the live parameters are
    this rank's stage's own, and a tied module only where a stage uses it."""
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, torch.nn.Parameter)}
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_head=4, n_layer=4, dropout=0.0)
    mesh = Mesh(pp=pp, tp=tp, dp=-1)
    torch.manual_seed(0)
    model = GPT(cfg)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    par = shardwise.parallelize(model, mesh, plans.gpt.plan(cfg, mesh))
    del model
    live = live_parameter_bytes(before)
    own = sum(p.numel() * p.element_size() for p in par.module.parameters())
    assert live == own, f"live parameter bytes {live} != this stage's {own}"
    return {
        "live": live,
        "whole": whole,
        "tied": sorted(par.module.tied.keys()),
        "pp_rank": mesh.rank(Axis.PP),
    }


def export_lora(stage: int, out: str, tp: int = 1, targets: tuple[str, ...] = TARGETS) -> dict:
    """A peft LoRA Llama at dp over every rank (``tp`` > 1: the adapters split with their
    layers): the adapter reloads into the base with ``PeftModel.from_pretrained``, the merged
    model with ``from_pretrained``; same logits."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0)
    model = get_peft_model(hf_model("llama"), lora)
    mesh = Mesh(dp=-1, tp=tp)
    plan = {f"base_model.model.{k}": v for k, v in plans.llama.tp_plan().items()}
    par = shardwise.parallelize(model, mesh, ParallelPlan(tensor=plan if tp > 1 else None))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine = shardwise.initialize(par, opt, shardwise.Config(zero_stage=stage))
    x = _tokens()
    _one_step(engine, x)
    with torch.no_grad():
        want = engine(input_ids=x).logits
    adapter, merged = Path(out) / "adapter", Path(out) / "merged"
    report = engine.save_pretrained(adapter, adapter_only=True)
    merged_report = engine.save_pretrained(merged, SHARD, merge=True)
    world = shardwise.comm.resolve(None)
    if world.rank == 0:
        base = hf_model("llama")  # the same seed: the base weights the adapter was trained on
        with torch.no_grad():
            got = PeftModel.from_pretrained(base, adapter).eval()(x).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert sorted(p.name for p in adapter.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        with torch.no_grad():
            got = AutoModelForCausalLM.from_pretrained(merged).float().eval()(x).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    shardwise.comm.barrier(group=world)
    return {"adapter": report.tensors, "merged": merged_report.tensors}


def checkpoint_dp_tp(out: str) -> torch.Tensor:
    """dp2 x tp2 Llama at ZeRO-1, one step, then a sharded checkpoint and the model's
    config.json under ``out``; returns the engine's logits."""
    mesh = Mesh(dp=2, tp=2)
    model = hf_model("llama")
    tp = tp_parallelize(model, mesh, plans.llama.tp_plan())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = shardwise.initialize(
        model, opt, shardwise.Config(zero_stage=1), group=mesh, placements=tp.placements
    )
    x = _tokens()
    _one_step(engine, x)
    with torch.no_grad():
        want = engine(x).logits
    engine.save(Path(out) / "ckpt")
    if shardwise.comm.resolve(None).rank == 0:
        model.config.save_pretrained(Path(out) / "src")
    return want


def spec_bytes(spec) -> int:
    return int(torch.Size(spec.shape).numel()) * spec.dtype.itemsize
