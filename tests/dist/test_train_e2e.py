"""``shardwise train`` end to end on 2 gloo ranks through the CLI, and the memory estimator
against what the engine holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise.checkpoint import verify
from shardwise.cli.main import main
from shardwise.cli.train_cmd import DEFAULT_MICRO_BATCH
from shardwise.estimate import estimate_model_states
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.testing import run_on_ranks
from shardwise.train.metrics import read_metrics
from shardwise.train.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--nproc-per-node", "2", "--model", "tiny", "--max-bytes", "1000000"]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardwise.cli.main", *args]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def _train(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(_cli("train", *TINY, *args), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=_env())


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    run_dir = RunDir(tmp_path_factory.mktemp("train") / "run")
    out = _train("--steps", "30", "--eval-every", "10", "--checkpoint-every", "10",
                 "--run-dir", str(run_dir.root))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "finished at step 30" in out.stdout
    return run_dir


def test_loss_falls_and_the_run_dir_is_complete(trained):
    records = read_metrics(trained.metrics)
    assert [r["step"] for r in records] == list(range(1, 31))
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20, 30]
    for r in records:
        assert len(r["memory"]) == 2 and r["tokens"] == DEFAULT_MICRO_BATCH * 2 * 64
        assert r["comm"]["all_reduce"]["bytes"] > 0 and len(r["exposed_comm_s"]) == 2
    summary = json.loads(trained.summary.read_text())
    assert summary["status"] == "finished" and summary["steps"] == 30
    assert summary["final_val_loss"] < summary["unigram_baseline"]
    est = summary["memory"]["estimated_per_rank"]
    for measured in summary["memory"]["measured_peak_per_rank"]:
        assert measured["model_states"] == est["model_states"]  # stage 0: nothing padded
    config = json.loads(trained.config.read_text())
    assert config["derived"]["global_batch_size"] == DEFAULT_MICRO_BATCH * 2
    assert config["shardwise"]["checkpoint_every"] == 10
    assert verify(trained.checkpoints / "step-00000030").step == 30
    assert trained.final_model.is_file()


def test_report_and_generate(trained, capsys):
    assert main(["report", str(trained.root)]) == 0
    for name in ("loss.png", "throughput.png", "memory.png", "comm.png"):
        assert (trained.report / name).read_bytes()[:4] == b"\x89PNG"
    assert "<img" in (trained.report / "report.html").read_text()
    capsys.readouterr()
    assert main(["generate", str(trained.root), "--prompt", "def ", "--tokens", "40"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def ") and len(out.out) > 30
    assert "step 30" in out.err


@pytest.mark.long
def test_ctrl_c_stops_every_rank_then_resume_continues(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    proc = subprocess.Popen(
        _cli("train", *TINY, "--zero", "3", "--steps", "3000", "--warmup-steps", "2",
             "--eval-every", "0",
             "--checkpoint-every", "4", "--run-dir", str(run_dir.root)),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
        start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if run_dir.metrics.exists() and len(read_metrics(run_dir.metrics)) >= 6:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C does to the launcher
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    summary = json.loads(run_dir.summary.read_text())
    stopped = summary["steps"]
    assert summary["status"] == "stopped by SIGINT" and 6 <= stopped < 3000
    assert verify(run_dir.checkpoints / f"step-{stopped:08d}").step == stopped
    assert f"--run-dir {run_dir.root} --resume" in output

    out = _train("--resume", "--run-dir", str(run_dir.root), "--steps", str(stopped + 4))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    records = read_metrics(run_dir.metrics)
    assert [r["step"] for r in records] == list(range(1, stopped + 5))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert json.loads(run_dir.summary.read_text())["status"] == "finished"


def test_zero1_with_gradient_accumulation(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    out = _train("--zero", "1", "--grad-accum", "4", "--micro-batch", "4", "--steps", "4",
                 "--eval-every", "2", "--checkpoint-every", "0", "--run-dir", str(run_dir.root))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    records = read_metrics(run_dir.metrics)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["tokens"] == 4 * 4 * 2 * 64 for r in records)
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    # stage 1 shards Adam's states: each rank holds half of them (plus padding)
    mem = records[-1]["memory"][0]
    assert mem["optimizer"] < 0.6 * 2 * mem["params"]
    assert list(run_dir.checkpoints.glob("step-*")) == [run_dir.checkpoints / "step-00000004"]


def _model_state_bytes(stage: int) -> tuple[dict[str, int], int, int]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.named("small"))
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  shardwise.Config(zero_stage=stage))
    x = torch.randint(0, 256, (2, 16))
    for _ in range(2):  # the second backward: gradients held and Adam's states exist
        engine.backward(engine(x, x))
        memory = engine.memory()
        engine.step()
    return memory, model.num_params(), len(engine.flats)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_matches_engine_memory(stage):
    results = run_on_ranks(2, _model_state_bytes, stage)
    for memory, num_params, num_flats in results:
        assert num_params == GPTConfig.named("small").param_count()
        est = estimate_model_states(num_params, 2, "fp32")[stage]
        # each flat buffer is padded to a multiple of the world size: < 2 elements each
        slack = 4 * 2 * num_flats
        for key, want in (("params", est.params_bytes), ("grads", est.grads_bytes),
                          ("optimizer", est.optimizer_bytes)):
            assert want <= memory[key] <= want + slack * (2 if key == "optimizer" else 1), (
                stage, key, memory[key], want)
