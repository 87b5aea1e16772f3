"""Tensor parallelism inside pipeline stages through the engine, on one dp x tp x pp mesh: the
tiny GPT split by ``pipeline_tp_plan`` matches one process (losses, clipped gradient norm, final
weights), and its checkpoint continues in one process."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import shardwise
from shardwise.parallel import tensor as swtp
from shardwise.checkpoint import CheckpointReader
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.plans.gpt import pipeline_layers, pipeline_tp_plan
from shardwise.parallel.pipeline import LayerStack, PipelineModule, Tied
from shardwise.testing import run_on_ranks

# vocab 17: padded over tp; bias=False: the attention key bias has an exactly-zero gradient
# that AdamW would amplify
CFG = GPTConfig(vocab_size=17, seq_len=4, d_model=8, n_head=2, n_layer=2, dropout=0.0, bias=False)
SEED, LR, CLIP, BATCH, STEPS, SAVED_AT = 7, 0.01, 0.05, 8, 3, 2


def gpt_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    shape = (BATCH, CFG.seq_len)
    return torch.randint(0, CFG.vocab_size, shape, generator=g), torch.randint(
        0, CFG.vocab_size, shape, generator=g
    )


def _gpt() -> GPT:
    torch.manual_seed(SEED)
    return GPT(CFG)


def _pipe_names(model: GPT) -> dict[str, str]:
    """The GPT's parameter names -> the pipeline's (``layers.{i}.*``, ``tied.tok_emb.*``)."""
    gpt_name = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for i, entry in enumerate(pipeline_layers(model)):
        prefix, module = (
            (f"tied.{entry.key}", entry.source)
            if isinstance(entry, Tied)
            else (f"layers.{i}", entry)
        )
        for n, p in module.named_parameters():
            out[gpt_name[id(p)]] = f"{prefix}.{n}"
    return out


def _reference() -> dict:
    """Every step in one process: losses, gradient norms, weights after each step."""
    model = _gpt()
    names = _pipe_names(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, weights = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(*_batch(step))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(loss.item())
        weights.append({names[n]: p.detach().clone() for n, p in model.named_parameters()})
    assert all(n > CLIP for n in norms), "clipping must be active"
    return {"losses": losses, "norms": norms, "weights": weights}


def _loss(mesh: shardwise.Mesh) -> functools.partial:
    """The vocab-parallel loss of the split head's logits over the mesh's tp axis."""
    group = mesh.group("tp")
    return functools.partial(
        swtp.vocab_parallel_cross_entropy, group=group, vocab_size=CFG.vocab_size
    )


def _engine(
    mesh: shardwise.Mesh, zero_stage: int, schedule: str = "1f1b", virtual_stages: int = 1
) -> shardwise.Engine:
    pipe = PipelineModule(
        pipeline_layers(_gpt()), _loss(mesh), mesh, virtual_stages=virtual_stages
    )
    tp = swtp.parallelize(pipe, mesh, pipeline_tp_plan(CFG))
    if mesh.tp_size > 1:
        assert any(p.shards for p in tp.placements.values()), "this stage is tensor-parallel"
    cfg = shardwise.Config(
        zero_stage=zero_stage,
        gradient_clipping=CLIP,
        pipeline_schedule=schedule,
        pipeline_microbatches=2,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    return shardwise.initialize(pipe, opt, cfg, group=mesh, placements=tp.placements)


def _flat_tp_engine(mesh: shardwise.Mesh) -> shardwise.Engine:
    """pp1: a plain engine over the ``LayerStack``, tensor-parallel by the same plan."""
    stack = LayerStack(pipeline_layers(_gpt()), _loss(mesh))
    tp = swtp.parallelize(stack, mesh, pipeline_tp_plan(CFG))
    cfg = shardwise.Config(zero_stage=2, gradient_clipping=CLIP)
    opt = torch.optim.AdamW(stack.parameters(), lr=LR)
    return shardwise.initialize(stack, opt, cfg, group=mesh, placements=tp.placements)


def _flat_steps(mesh: shardwise.Mesh, engine: shardwise.Engine, steps: range) -> dict:
    dp, n = mesh.rank("dp"), mesh.dp_size
    losses, norms = [], []
    for step in steps:
        x, y = (t.chunk(n)[dp] for t in _batch(step))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().reshape(1)
        if n > 1:
            shardwise.all_reduce(mean, op="avg", group=mesh.group("dp"))
        losses.append(mean.item())
        norms.append(engine.grad_norm)
    return {"losses": losses, "norms": norms, "state": engine.state_dict()}


def _interleaved() -> dict:
    """tp2 x pp2, two model chunks per rank (interleaved 1F1B), ZeRO-2."""
    mesh = shardwise.Mesh(dp=1, tp=2, pp=2)
    return _steps(mesh, _engine(mesh, 2, "interleaved_1f1b", 2), range(STEPS))


def _unmatched_refusal() -> str:
    mesh = shardwise.Mesh(dp=1, tp=2, pp=2)
    pipe = PipelineModule(pipeline_layers(_gpt()), _loss(mesh), mesh)
    try:
        swtp.parallelize(pipe, mesh, {**pipeline_tp_plan(CFG), "layers.*.mlp.nothing": "colwise"})
    except ValueError as exc:
        return str(exc)
    return "accepted"


def _steps(mesh: shardwise.Mesh, engine: shardwise.Engine, steps: range) -> dict:
    dp, n = mesh.rank("dp"), mesh.dp_size
    losses, norms = [], []
    for step in steps:
        x, y = _batch(step)
        losses.append(engine.train_batch(x.chunk(n)[dp], y.chunk(n)[dp]).item())
        norms.append(engine.grad_norm)
    return {"losses": losses, "norms": norms, "state": engine.state_dict()}


def _dp2_tp2_pp2() -> dict:
    """ZeRO-1 and ZeRO-3 over dp of each stage, one mesh each."""
    torch.set_num_threads(1)
    out = {}
    for zero_stage in (1, 3):
        mesh = shardwise.Mesh(dp=2, tp=2, pp=2)
        out[zero_stage] = _steps(mesh, _engine(mesh, zero_stage), range(STEPS))
    return out


def _tp2_pp2_save(root: str, again: str) -> dict:
    """ZeRO-0; saved after ``SAVED_AT`` steps, then continued; the checkpoint continued at
    tp1 x pp2 and at tp2 x pp1, whose own checkpoint loads back at tp2 x pp2."""
    torch.set_num_threads(1)
    mesh = shardwise.Mesh(dp=1, tp=2, pp=2)
    engine = _engine(mesh, 0)
    before = _steps(mesh, engine, range(SAVED_AT))
    engine.save(root)
    after = _steps(mesh, engine, range(SAVED_AT, STEPS))
    # the same checkpoint at dp2 x pp2 (tp1, ZeRO-3) and at dp2 x tp2 (pp1, ZeRO-2)
    mesh = shardwise.Mesh(dp=2, tp=1, pp=2)
    engine = _engine(mesh, 3)
    engine.load(root)
    pp_only = _steps(mesh, engine, range(SAVED_AT, STEPS))
    mesh = shardwise.Mesh(dp=2, tp=2, pp=1)
    engine = _flat_tp_engine(mesh)
    engine.load(root)
    tp_only = _flat_steps(mesh, engine, range(SAVED_AT, STEPS))
    engine.save(again)  # and back: the pp1 checkpoint at tp2 x pp2
    mesh = shardwise.Mesh(dp=1, tp=2, pp=2)
    engine = _engine(mesh, 1)
    engine.load(again)
    return {
        "back": engine.state_dict(),
        "before": before,
        "after": after,
        "pp_only": pp_only,
        "tp_only": tp_only,
        "refused": _unmatched_refusal(),
        "interleaved": _interleaved(),
    }


def _continue_in_one_process(root: str) -> dict:
    """pp1 x tp1: a plain engine over the ``LayerStack`` of the same layers."""
    stack = LayerStack(pipeline_layers(_gpt()), gpt_loss)
    cfg = shardwise.Config(gradient_clipping=CLIP)
    engine = shardwise.initialize(stack, torch.optim.AdamW(stack.parameters(), lr=LR), cfg)
    engine.load(root)
    at = engine.global_step
    losses, norms = [], []
    for step in range(SAVED_AT, STEPS):
        loss = engine(*_batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.grad_norm)
    return {"at": at, "losses": losses, "norms": norms, "state": engine.state_dict()}


def _check(got: dict, ref: dict, steps: range) -> None:
    want_losses = [ref["losses"][s] for s in steps]
    want_norms = [ref["norms"][s] for s in steps]
    assert got["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
    assert got["norms"] == pytest.approx(want_norms, rel=1e-5, abs=1e-6)
    want = ref["weights"][steps[-1]]
    for k, v in got["state"].items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=k)


def _stages_cover(outs: list[dict], ref: dict) -> None:
    held: set[str] = set()
    for out in outs:
        held |= set(out["state"])
    assert held == set(ref["weights"][0])


def test_gpt_dp2_tp2_pp2_matches_one_process() -> None:
    """8 ranks, 1F1B, AdamW with clipping, at ZeRO-1 and ZeRO-3: losses, the clipped gradient
    norm (tp-split weights summed over tp, replicated ones once, stages summed, the tied
    embedding once) and every stage's full weights equal one process's."""
    ref = _reference()
    outs = run_on_ranks(8, _dp2_tp2_pp2, timeout_s=900)
    for zero_stage in (1, 3):
        for out in outs:
            _check(out[zero_stage], ref, range(STEPS))
        _stages_cover([out[zero_stage] for out in outs], ref)


def test_gpt_tp2_pp2_checkpoint_continues_in_one_process(tmp_path: Path) -> None:
    """4 ranks at ZeRO-0 match one process; the checkpoint saved there (each tp piece a box of
    the whole tensor, the tied embedding once) continues identically at tp1 x pp2 (ZeRO-3), at
    tp2 x pp1 (ZeRO-2, a tensor-parallel ``LayerStack``) and at pp1 x tp1 in one process; the
    tp2 x pp1 checkpoint loads back at tp2 x pp2; interleaved 1F1B (two chunks per rank) at
    ZeRO-2 matches too; a plan pattern matching no stage is refused."""
    ref = _reference()
    root = str(tmp_path / "ckpt")
    outs = run_on_ranks(4, _tp2_pp2_save, root, str(tmp_path / "again"), timeout_s=900)
    for out in outs:
        _check(out["before"], ref, range(SAVED_AT))
        _check(out["after"], ref, range(SAVED_AT, STEPS))
    _stages_cover([out["after"] for out in outs], ref)
    for out in outs:
        _check(out["pp_only"], ref, range(SAVED_AT, STEPS))
        _check(out["tp_only"], ref, range(SAVED_AT, STEPS))
        assert set(out["tp_only"]["state"]) == set(ref["weights"][0])
        for k, v in out["back"].items():
            torch.testing.assert_close(v, out["tp_only"]["state"][k], rtol=0, atol=0, msg=k)
        assert "'layers.*.mlp.nothing'" in out["refused"], out["refused"]
        _check(out["interleaved"], ref, range(STEPS))
    with CheckpointReader(root) as reader:
        for name in ("model/layers.2.attn.q_proj.weight", "model/tied.tok_emb.weight"):
            record = reader.manifest.tensors[name]
            assert len(record.pieces) == 2  # one per tp rank, written once over the tied copies
            assert sum(torch.Size(p.shape).numel() for p in record.pieces) == record.numel
    one = run_on_ranks(1, _continue_in_one_process, root, timeout_s=600)[0]
    assert one["at"] == SAVED_AT
    _check(one, ref, range(SAVED_AT, STEPS))
    assert set(one["state"]) == set(ref["weights"][0])


def _sequence_parallel_refused() -> str:
    mesh = shardwise.Mesh(dp=1, tp=2, pp=1)
    stack = LayerStack(pipeline_layers(_gpt()), _loss(mesh))
    swtp.parallelize(stack, mesh, pipeline_tp_plan(CFG), sequence_parallel=True)
    try:
        stack(*_batch(0))
    except ValueError as exc:
        return str(exc)
    return "ran"


def test_gpt_pipeline_layers_refuse_sequence_parallelism() -> None:
    """Not silently wrong: the positions layer would add a slice of a slice of the positions."""
    for got in run_on_ranks(2, _sequence_parallel_refused):
        assert "pass sequence_parallel_size=tp to pipeline_layers" in got, got
