"""Checkpoints of pipeline engines across (pp, dp) layouts: saved at dp2 x pp2, continued at pp4,
at pp2 and in a plain engine over the whole model (pp1, dp2), each as if never interrupted."""

from __future__ import annotations

from pathlib import Path

import pipeline_cases as pc
import pytest
import torch

import shardwise
from shardwise.checkpoint import CheckpointError, CheckpointReader
from shardwise.parallel.pipeline import LayerStack, PipelineModule
from shardwise.testing import run_on_ranks

N_BLOCKS = 2  # [embed][block][block][head]: one entry per stage at pp4
STEPS = 4
SAVED_AT = 2
CLIP = 0.5
LR = 0.02
BATCH = 8


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Every step in one process, never interrupted: losses and final weights."""
    ref = pc.Reference(N_BLOCKS)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = ref(*pc.batch(BATCH, seed=step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, {k: p.detach().clone() for k, p in ref.named_like_pipeline().items()}


def _config(stage: int) -> shardwise.Config:
    return shardwise.Config(zero_stage=stage, gradient_clipping=CLIP, pipeline_microbatches=2)


def _dp_batch(step: int, dp: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = pc.batch(BATCH, seed=step)
    return x.chunk(dp_size)[dp], y.chunk(dp_size)[dp]


def _pipe_engine(pp: int, dp: int, stage: int) -> tuple[shardwise.Mesh, shardwise.Engine]:
    mesh = shardwise.Mesh(pp=pp, dp=dp)
    pipe = PipelineModule(pc.layers(N_BLOCKS), pc.lm_loss, mesh, seed=pc.SEED)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    return mesh, shardwise.initialize(pipe, opt, _config(stage), group=mesh)


def _pipe_steps(mesh: shardwise.Mesh, engine: shardwise.Engine, steps: range) -> list[float]:
    dp, n = mesh.rank("dp"), mesh.dp_size
    return [engine.train_batch(*_dp_batch(s, dp, n)).item() for s in steps]


def _continue_pipe(root: str, pp: int, dp: int, stage: int) -> dict:
    mesh, engine = _pipe_engine(pp, dp, stage)
    engine.load(root)
    at = engine.global_step
    losses = _pipe_steps(mesh, engine, range(SAVED_AT, STEPS))
    return {"at": at, "losses": losses, "state": engine.state_dict(), "steps": engine.global_step}


def _save_then_pp4(root: str) -> dict:
    """Save at dp2 x pp2 (ZeRO 3) after ``SAVED_AT`` steps; continue at pp4 (ZeRO 0)."""
    torch.set_num_threads(1)
    mesh, engine = _pipe_engine(2, 2, 3)
    before = _pipe_steps(mesh, engine, range(SAVED_AT))
    engine.save(root)
    return {"before": before, "pp4": _continue_pipe(root, 4, 1, 0)}


def _continue_plain(root: str, again: str) -> dict:
    """A plain engine over the whole model (pp1, dp = every rank), ZeRO 1; at the end it saves
    into ``again``."""
    stack = LayerStack(pc.layers(N_BLOCKS), pc.lm_loss, seed=pc.SEED)
    engine = shardwise.initialize(stack, torch.optim.AdamW(stack.parameters(), lr=LR), _config(1))
    engine.load(root)
    at = engine.global_step
    losses = []
    for step in range(SAVED_AT, STEPS):
        loss = engine(*_dp_batch(step, shardwise.rank(), shardwise.world_size()))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().reshape(1)
        shardwise.all_reduce(mean, op="avg")
        losses.append(mean.item())
    engine.save(again)
    return {"at": at, "losses": losses, "state": engine.state_dict(), "steps": engine.global_step}


def _corrupted(step_dir: str) -> str:
    """Flip bytes in the shard file of the last rank that saved; the load must refuse it."""
    if shardwise.rank() == 0:
        shard = sorted(Path(step_dir).glob("shard-*.safetensors"))[-1]
        data = bytearray(shard.read_bytes())
        data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
        shard.write_bytes(bytes(data))
    shardwise.barrier()
    _, engine = _pipe_engine(2, 1, 0)
    try:
        engine.load(step_dir)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def _back_to_pp2(again: str) -> dict[str, torch.Tensor]:
    """The plain engine's checkpoint loaded at pp2: this stage's weights."""
    _, engine = _pipe_engine(2, 1, 1)
    engine.load(again)
    return engine.state_dict()


def _elsewhere(root: str, step_dir: str, again: str) -> dict:
    torch.set_num_threads(1)
    return {
        "pp2": _continue_pipe(root, 2, 1, 2),
        "plain": _continue_plain(root, again),
        "back": _back_to_pp2(again),
        "corrupted": _corrupted(step_dir),
    }


def _check_continued(out: dict, losses: list[float], want: dict[str, torch.Tensor]) -> None:
    assert (out["at"], out["steps"]) == (SAVED_AT, STEPS)
    assert out["losses"] == pytest.approx(losses[SAVED_AT:], rel=1e-5)
    for k, v in out["state"].items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_pipeline_checkpoint_continues_at_other_layouts(tmp_path: Path) -> None:
    """Saved at dp2 x pp2 (ZeRO-3), loaded at pp4, at pp2 (another dp and ZeRO stage) and into
    a plain engine on the ``LayerStack`` of the same layers: the continued losses and weights
    are the uninterrupted single-process run's; the tied weight is stored once; the plain
    engine's own checkpoint loads back at pp2; a damaged shard file is refused by name."""
    losses, want = _reference()
    root = str(tmp_path / "ckpt")
    saved = run_on_ranks(4, _save_then_pp4, root, timeout_s=900)
    held: set[str] = set()
    for out in saved:
        assert out["before"] == pytest.approx(losses[:SAVED_AT], rel=1e-5)
        _check_continued(out["pp4"], losses, want)
        held |= set(out["pp4"]["state"])
    assert held == set(want)

    with CheckpointReader(root) as reader:
        step_dir = str(reader.path)
        assert reader.trainer_state["pp_size"] == 2
        for name in ("model/tied.embed.weight", "optim/tied.embed.weight/exp_avg"):
            record = reader.manifest.tensors[name]
            stored = sum(torch.Size(piece.shape).numel() for piece in record.pieces)
            assert stored == record.numel  # once, though both pp ranks hold it
            # written by the first holder's ranks only (pp 0: global ranks 0 and 1)
            assert {piece.file for piece in record.pieces} <= {
                "shard-00000-of-00004.safetensors",
                "shard-00001-of-00004.safetensors",
            }

    again = str(tmp_path / "again")
    for out in run_on_ranks(2, _elsewhere, root, step_dir, again, timeout_s=900):
        _check_continued(out["pp2"], losses, want)
        _check_continued(out["plain"], losses, want)
        for k, v in out["back"].items():
            torch.testing.assert_close(v, out["plain"]["state"][k], rtol=0, atol=0, msg=k)
        assert "shard-00003-of-00004.safetensors" in out["corrupted"], out["corrupted"]
