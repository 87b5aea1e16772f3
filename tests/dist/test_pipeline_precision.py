"""bf16 / fp16 on the pipeline engine against the flat engine in one process, and fp16 overflow
on one stage skipping the step on every rank of the mesh."""

from __future__ import annotations

import pipeline_cases as pc
import pytest
import torch
from test_mixed_precision import TOLERANCE

import shardwise
from shardwise.parallel.pipeline import PipelineModule
from shardwise.testing import run_on_ranks

N_BLOCKS = 2  # [embed | block] [block | head]: two stages of equal size
STEPS = 4
CLIP = 0.5
LR = 0.02
BATCH = 8
POISONED_STEP = 2


def _config(precision: str, stage: int = 0, m: int = 1) -> shardwise.Config:
    return shardwise.Config(
        zero_stage=stage,
        precision=precision,
        gradient_clipping=CLIP,
        initial_loss_scale_power=8,  # no overflow on this model but where a test injects one
        pipeline_microbatches=m,
    )


def _flat_task(precision: str) -> list[float]:
    """The whole model on one rank, the flat engine: the loss of every step."""
    torch.set_num_threads(1)
    ref = pc.Reference(N_BLOCKS)
    engine = shardwise.initialize(
        ref, torch.optim.AdamW(ref.parameters(), lr=LR), _config(precision)
    )
    losses = []
    for step in range(STEPS):
        loss = engine(*pc.batch(BATCH, seed=step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _pipe_engine(mesh: shardwise.Mesh, precision: str, stage: int) -> shardwise.Engine:
    pipe = PipelineModule(pc.layers(N_BLOCKS), pc.lm_loss, mesh, seed=pc.SEED)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    return shardwise.initialize(pipe, opt, _config(precision, stage, m=2), group=mesh)


def _my_batch(mesh: shardwise.Mesh, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = pc.batch(BATCH, seed=step)
    dp = mesh.rank("dp")
    return x.chunk(mesh.dp_size)[dp], y.chunk(mesh.dp_size)[dp]


def _curve(mesh: shardwise.Mesh, precision: str, stage: int) -> dict:
    engine = _pipe_engine(mesh, precision, stage)
    losses = [engine.train_batch(*_my_batch(mesh, s)).item() for s in range(STEPS)]
    state = engine.state_dict()
    return {
        "losses": losses,
        "skipped": engine.skipped_steps,
        "master_fp32": all(v.dtype == torch.float32 for v in state.values()),
        "compute": {p.dtype for p in engine.module.parameters()},
    }


def _poisoned(mesh: shardwise.Mesh, stage: int) -> list[tuple]:
    """fp16 steps; at ``POISONED_STEP`` only the rank at pp 0 and the last dp coordinate gets
    an inf in one block's weight gradient (not tied: no other stage sees it)."""
    engine = _pipe_engine(mesh, "fp16", stage)
    pipe = engine.module
    assert isinstance(pipe, PipelineModule)
    poison = mesh.rank("pp") == 0 and mesh.rank("dp") == mesh.dp_size - 1
    record = []
    for step in range(STEPS):
        handle = None
        if poison and step == POISONED_STEP:
            weight = pipe.layers["1"].fc.weight
            handle = weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        before = engine.state_dict()
        scale = engine.scaler.scale
        engine.train_batch(*_my_batch(mesh, step))
        if handle is not None:
            handle.remove()
        after = engine.state_dict()
        changed = any(not torch.equal(before[k], after[k]) for k in before)
        record.append((engine.global_step, scale, engine.scaler.scale, changed))
    return record


def _task(dp: int, curves: list[tuple[str, int]], poisoned_stages: list[int]) -> dict:
    torch.set_num_threads(1)
    mesh = shardwise.Mesh(pp=shardwise.world_size() // dp, dp=dp)
    return {
        "curves": [_curve(mesh, precision, stage) for precision, stage in curves],
        "poisoned": [_poisoned(mesh, stage) for stage in poisoned_stages],
    }


_flat: dict[str, list[float]] = {}


def _flat_losses(precision: str) -> list[float]:
    if precision not in _flat:
        _flat[precision] = run_on_ranks(1, _flat_task, precision)[0]
    return _flat[precision]


def _check(results: list[dict], curves: list[tuple[str, int]]) -> None:
    for i, (precision, _stage) in enumerate(curves):
        want = _flat_losses(precision)
        for out in results:
            got = out["curves"][i]
            rel = [abs(a - b) / b for a, b in zip(got["losses"], want)]
            assert max(rel) < TOLERANCE[precision], (curves[i], rel)
            assert got["skipped"] == 0 and got["master_fp32"]
            assert got["compute"] == {torch.bfloat16}
    for record in (r for out in results for r in out["poisoned"]):
        for step, (steps_done, before, after, changed) in enumerate(record):
            if step == POISONED_STEP:  # every rank skips and halves the scale
                assert (steps_done, after, changed) == (step, before / 2, False), step
            else:
                assert (steps_done, after, changed) == (step + (step < POISONED_STEP), before, True)
    first = results[0]["poisoned"]
    assert all(out["poisoned"] == first for out in results)


@pytest.mark.parametrize(
    "world, dp, curves, poisoned_stages",
    [(2, 1, [("bf16", 0)], [0]), (4, 2, [("bf16", 1), ("bf16", 3)], [2, 3])],
    ids=["pp2", "dp2xpp2"],
)
def test_pipeline_mixed_precision(world, dp, curves, poisoned_stages) -> None:
    """bf16 over a pipeline (ZeRO 0 at pp2, 1 and 3 at dp2 x pp2) follows the flat
    single-process bf16 engine within the mixed-precision tolerance, with fp32 masters; fp16
    (ZeRO 0 at pp2, 2 and 3 at dp2 x pp2) with an inf on one rank of one stage: every rank
    skips that step and halves the scale, then trains on."""
    results = run_on_ranks(world, _task, dp, curves, poisoned_stages, timeout_s=900)
    _check(results, curves)
