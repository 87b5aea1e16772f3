"""``shardwise train --tp`` end to end through the CLI on gloo ranks, against the same run on one
process: equal losses (fp32), a resume, and the exported model in the plain GPT's names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardwise.checkpoint import verify
from shardwise.cli.main import main
from shardwise.checkpoint import read_consolidated
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.train.metrics import read_metrics
from shardwise.train.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny", "--max-bytes", "200000", "--eval-every", "2", "--eval-batches", "2"]
STEPS = 4


def train(*args: str) -> subprocess.CompletedProcess:
    """``shardwise train`` on the tiny GPT in a subprocess; fails the test on a non-zero exit."""
    out = subprocess.run(
        [sys.executable, "-m", "shardwise.cli.main", "train", *TINY, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def losses(run_dir: RunDir) -> tuple[list[float], list[float]]:
    records = read_metrics(run_dir.metrics)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records], [r["val_loss"] for r in records if "val_loss" in r]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    run_dir = RunDir(tmp_path_factory.mktemp("one") / "run")
    train(
        "--nproc-per-node",
        "1",
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        "0",
        "--run-dir",
        str(run_dir.root),
    )
    return run_dir


@pytest.fixture(scope="module")
def tp_resumed(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """tp2 for half the steps, then resumed to the end."""
    run_dir = RunDir(tmp_path_factory.mktemp("tp") / "run")
    common = ["--nproc-per-node", "2", "--checkpoint-every", "2", "--run-dir", str(run_dir.root)]
    out = train("--tp", "2", "--steps", str(STEPS // 2), *common)
    assert "2 ranks (tp2)" in out.stdout
    train("--resume", "--steps", str(STEPS), *common)
    return run_dir


def test_tp2_resumed_run_matches_one_process(one_process, tp_resumed):
    (want, want_val), (got, got_val) = losses(one_process), losses(tp_resumed)
    assert len(got) == STEPS and len(got_val) == STEPS // 2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got_val), torch.tensor(want_val), rtol=0, atol=1e-5)
    assert verify(tp_resumed.checkpoints / "step-00000002").step == 2
    assert verify(tp_resumed.checkpoints / f"step-{STEPS:08d}").step == STEPS
    config = json.loads(tp_resumed.config.read_text())
    assert config["train"]["tp"] == 2 and config["derived"]["dp_size"] == 1
    summary = json.loads(tp_resumed.summary.read_text())
    assert summary["status"] == "finished" and summary["steps"] == STEPS
    est = summary["memory"]["estimated_per_rank"]["model_states"]
    for measured in summary["memory"]["measured_peak_per_rank"]:
        assert measured["model_states"] == est  # ZeRO-0 at tp2: each rank's tp shard, exactly


def test_tp2_final_model_is_the_plain_gpt(one_process, tp_resumed, capsys):
    state = load_file(str(tp_resumed.final_model))
    model = GPT(GPTConfig.named("tiny"))
    model.load_state_dict(state)  # strict: the plain model's names and shapes, no padding
    saved = read_consolidated(tp_resumed.checkpoints / f"step-{STEPS:08d}")
    reference = load_file(str(one_process.final_model))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
        # Adam divides by sqrt(v): an entry of near-zero gradient amplifies summation order
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-4)
    capsys.readouterr()
    assert main(["generate", str(tp_resumed.root), "--prompt", "def ", "--tokens", "8"]) == 0
    assert f"step {STEPS}" in capsys.readouterr().err


def test_dp2_tp2_sequence_parallel_matches_one_process(one_process, tmp_path):
    # 4 ranks: dp2 x tp2, each dp replica reads half of the 8 sequences the single process does
    run_dir = RunDir(tmp_path / "run")
    out = train(
        "--nproc-per-node",
        "4",
        "--tp",
        "2",
        "--sequence-parallel",
        "--micro-batch",
        "4",
        "--steps",
        "2",
        "--checkpoint-every",
        "0",
        "--run-dir",
        str(run_dir.root),
    )
    assert "4 ranks (dp2 x tp2)" in out.stdout
    (want, want_val), (got, got_val) = losses(one_process), losses(run_dir)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want[:2]), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got_val), torch.tensor(want_val[:1]), rtol=0, atol=1e-5)
