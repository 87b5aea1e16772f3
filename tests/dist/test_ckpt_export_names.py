"""``shardwise checkpoint export`` gives the plain GPT's names from any layout (#22): a pp2 and a
tp2 run's checkpoint export to a file that loads into ``GPT`` with ``strict=True`` and holds the
run's weights exactly; a pipeline checkpoint that records no mapping to a plain model says that
it wrote the pipeline's names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pipeline_cases as pc
import pytest
import torch
from safetensors.torch import load_file

import shardwise
from shardwise.cli.main import main
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.pipeline import PipelineModule
from shardwise.testing import run_on_ranks
from shardwise.train.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny", "--max-bytes", "200000", "--eval-every", "0"]


def _train(run_dir: RunDir, *layout: str) -> None:
    """Two steps of ``shardwise train`` on 2 ranks, a checkpoint at step 2."""
    out = subprocess.run(
        [sys.executable, "-m", "shardwise.cli.main", "train", *TINY, "--nproc-per-node", "2",
         *layout, "--steps", "2", "--checkpoint-every", "2", "--run-dir", str(run_dir.root)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


@pytest.mark.parametrize(
    "layout",
    [pytest.param(["--pp", "2"], marks=pytest.mark.long), ["--tp", "2"]],
    ids=["pp2", "tp2"],
)
def test_export_of_a_run_loads_into_the_plain_gpt(tmp_path, capsys, layout):
    run_dir = RunDir(tmp_path / "run")
    _train(run_dir, *layout)
    out = tmp_path / "model.safetensors"
    capsys.readouterr()
    assert main(["checkpoint", "export", str(run_dir.checkpoints), str(out)]) == 0
    printed = capsys.readouterr().out
    model = GPT(GPTConfig.named("tiny"))
    # strict: every name of the plain GPT, whole shapes, nothing else
    model.load_state_dict(load_file(str(out)), strict=True)
    n = len(model.state_dict())
    # the engine's full state dict of the last step, gathered under the GPT's names
    final = load_file(str(run_dir.final_model))
    assert set(final) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, final[name], rtol=0, atol=0)
    naming = "under the plain model's names" + (
        " (renamed from the pipeline's)" if layout[0] == "--pp" else ""
    )
    assert printed.startswith(
        f"exported {n} tensors (fp32 model state, tied aliases included) {naming} to {out}"
    )


def _save_pipeline(root: str) -> dict[str, torch.Tensor]:
    """A pp2 engine over a user's own pipeline layers (no plain model to name them after):
    one step, saved; this rank's state dict under the pipeline's names."""
    torch.set_num_threads(1)
    mesh = shardwise.Mesh(pp=2, dp=1)
    pipe = PipelineModule(pc.layers(2), pc.lm_loss, mesh, seed=pc.SEED)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    config = shardwise.Config(pipeline_microbatches=2)
    engine = shardwise.initialize(pipe, opt, config, group=mesh)
    engine.train_batch(*pc.batch(4))
    engine.save(root)
    return engine.state_dict()


def test_export_of_a_pipeline_without_plain_names_says_which_names_it_wrote(tmp_path, capsys):
    root = tmp_path / "ckpt"
    parts = run_on_ranks(2, _save_pipeline, str(root))
    out = tmp_path / "model.safetensors"
    capsys.readouterr()
    assert main(["checkpoint", "export", str(root), str(out)]) == 0
    printed = capsys.readouterr().out
    written = load_file(str(out))
    full = {**parts[0], **parts[1]}
    assert set(written) == set(full) and any(k.startswith("tied.") for k in written)
    for name, tensor in full.items():
        torch.testing.assert_close(written[name], tensor.float(), rtol=0, atol=0)
    assert (
        "under the pipeline's names (layers.{i}.*, tied.{key}.*), not a plain model's: the "
        "checkpoint records no mapping to them (shardwise train records one)"
    ) in printed
