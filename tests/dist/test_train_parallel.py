"""``shardwise train --tp`` and ``--pp`` end to end through the CLI on gloo ranks, against the
same run on one process: equal losses (fp32) across a resume, per-stage timings and the bubble
(pp), and the exported model in the plain GPT's names."""

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
from shardwise.train.checkpoints import load_model
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


def two_steps_on_four_ranks(run_dir: RunDir, *layout: str) -> str:
    """Two steps of ``shardwise train`` on 4 ranks in ``layout``, no checkpoints; its stdout."""
    out = train("--nproc-per-node", "4", *layout, "--steps", "2", "--checkpoint-every", "0",
                "--run-dir", str(run_dir.root))  # fmt: skip
    return out.stdout


def assert_two_steps_match(one_process: RunDir, run_dir: RunDir) -> None:
    """The run's first two losses and first validation loss are the single process's."""
    (want, want_val), (got, got_val) = losses(one_process), losses(run_dir)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want[:2]), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got_val), torch.tensor(want_val[:1]), rtol=0, atol=1e-5)


@pytest.mark.long
def test_dp2_tp2_sequence_parallel_matches_one_process(one_process, tmp_path):
    # 4 ranks: dp2 x tp2, each dp replica reads half of the 8 sequences the single process does
    run_dir = RunDir(tmp_path / "run")
    out = two_steps_on_four_ranks(run_dir, "--tp", "2", "--sequence-parallel", "--micro-batch", "4")
    assert "4 ranks (dp2 x tp2)" in out
    assert_two_steps_match(one_process, run_dir)


@pytest.mark.long
def test_dp4_hierarchical_sharding_matches_one_process(one_process, tmp_path):
    # 4 ranks: 2 replicas x ZeRO-3 over 2 ranks, each rank reading 2 of the 8 sequences
    run_dir = RunDir(tmp_path / "run")
    layout = ["--dp-replicate", "2", "--zero", "3", "--micro-batch", "2"]
    assert "4 ranks (dp4 (2 replicas of 2))" in two_steps_on_four_ranks(run_dir, *layout)
    assert_two_steps_match(one_process, run_dir)
    # sharded over 2 ranks, not 4; the replicas all-reduce this rank's gradient shard
    full = read_metrics(one_process.metrics)[0]["memory"][0]["params"]
    for record in read_metrics(run_dir.metrics):
        assert [m["params"] for m in record["memory"]] == [full // 2] * 4
        assert record["comm"]["all_reduce"]["bytes"] >= full // 2


def check_final_model(run_dir: RunDir, reference: RunDir) -> None:
    """The run's final_model.safetensors loads into the plain GPT and is the one-process run's."""
    state = load_file(str(run_dir.final_model))
    model = GPT(GPTConfig.named("tiny"))
    model.load_state_dict(state)  # strict: every name of the plain model, whole shapes
    want = load_file(str(reference.final_model))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=1e-4)


@pytest.mark.long
def test_pp2_1f1b_resumed_matches_one_process_with_stage_times(one_process, tmp_path, capsys):
    run_dir = RunDir(tmp_path / "run")
    common = ["--nproc-per-node", "2", "--checkpoint-every", "2", "--run-dir", str(run_dir.root)]
    pipeline = ["--pp", "2", "--schedule", "1f1b", "--microbatches", "2"]
    out = train(*pipeline, "--steps", str(STEPS // 2), *common)
    assert "2 ranks (pp2)" in out.stdout
    train("--resume", "--steps", str(STEPS), *common)
    (want, want_val), (got, got_val) = losses(one_process), losses(run_dir)
    assert len(got) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got_val), torch.tensor(want_val), rtol=0, atol=1e-5)
    for record in read_metrics(run_dir.metrics):
        pipe = record["pipeline"]
        assert [(s["stage"], s["pp_rank"]) for s in pipe["stages"]] == [(0, 0), (1, 1)]
        assert all(s["forward_s"] > 0 and s["backward_s"] > 0 for s in pipe["stages"])
        assert 0 <= pipe["bubble_fraction"] < 1
    config = json.loads(run_dir.config.read_text())
    assert config["train"]["pp"] == 2 and config["shardwise"]["pipeline_microbatches"] == 2
    assert json.loads(run_dir.summary.read_text())["status"] == "finished"
    assert verify(run_dir.checkpoints / f"step-{STEPS:08d}").step == STEPS
    check_final_model(run_dir, one_process)
    # the checkpoint holds the pipeline's names; generate reads it as the plain GPT
    model, step, _ = load_model(GPTConfig.named("tiny"), tmp_path / "none", run_dir.checkpoints)
    final = load_file(str(run_dir.final_model))
    assert step == STEPS
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, final[name], rtol=0, atol=0)
    capsys.readouterr()
    assert main(["generate", str(run_dir.root), "--prompt", "def ", "--tokens", "8"]) == 0


@pytest.mark.parametrize(
    "layout",
    [
        ["--schedule", "zb_h1", "--micro-batch", "4", "--zero", "3"],  # pp2 x dp2
        pytest.param(  # pp2 x (2 replicas of 1)
            ["--micro-batch", "4", "--zero", "1", "--dp-replicate", "2"], marks=pytest.mark.long
        ),
    ],
    ids=["pp2_dp2_zero3_zb_h1", "pp2_hsdp_zero1"],
)
def test_pp2_on_four_ranks_matches_one_process(one_process, tmp_path, layout):
    run_dir = RunDir(tmp_path / "run")
    train(
        "--nproc-per-node",
        "4",
        "--pp",
        "2",
        "--microbatches",
        "2",
        *layout,
        "--steps",
        "2",
        "--run-dir",
        str(run_dir.root),
    )
    assert_two_steps_match(one_process, run_dir)
    stages = read_metrics(run_dir.metrics)[-1]["pipeline"]["stages"]
    assert len(stages) == 2


@pytest.mark.long
def test_pp2_tp2_sp_interleaved_matches_one_process(tmp_path):
    """Interleaved 1F1B runs pp x 2 stages, each needing a transformer block: the small GPT's 4
    blocks on pp2 x tp2 with sequence parallelism (the tiny one's 2 are refused)."""
    small = ["--model", "small", "--steps", "2", "--checkpoint-every", "0"]
    one = RunDir(tmp_path / "one")
    train(*small, "--nproc-per-node", "1", "--run-dir", str(one.root))
    run_dir = RunDir(tmp_path / "run")
    train(
        *small,
        *("--nproc-per-node", "4", "--pp", "2", "--microbatches", "2", "--tp", "2"),
        *("--sequence-parallel", "--schedule", "interleaved_1f1b", "--run-dir", str(run_dir.root)),
    )
    assert_two_steps_match(one, run_dir)
    assert len(read_metrics(run_dir.metrics)[-1]["pipeline"]["stages"]) == 4
