"""``shardwise train`` under faults, as real processes: the launcher killed (-9) while a second
job knocks, a rank killed with restarts left, SIGTERM with and without time to save."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable

import psutil
import pytest
from launcher_procs import TINY_TRAIN, Cli, assert_all_gone, wait_ranks

from shardwise.checkpoint import verify
from shardwise.train.metrics import read_metrics
from shardwise.train.rundir import RunDir


def _train(run_dir: RunDir, *args: str) -> Cli:
    return Cli("train", "--nproc-per-node", "2", *TINY_TRAIN, "--run-dir", str(run_dir.root), *args)


def _wait_steps(run_dir: RunDir, cli: Cli, n: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not (run_dir.metrics.exists() and len(read_metrics(run_dir.metrics)) >= n):
        if cli.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no step {n}:\n{cli.output[-4000:]}")
        time.sleep(0.1)


def _stop_midway(run_dir: RunDir, cli: Cli, stop: Callable[[list[psutil.Process]], None]) -> int:
    """After step 3, ``stop(ranks)``; returns the launcher's exit code once no rank is left."""
    try:
        _wait_steps(run_dir, cli, 3)
        ranks = wait_ranks(cli, 2)
        stop(ranks)
        code = cli.finish()
        assert_all_gone(ranks)
        return code
    finally:
        cli.cleanup()


def _steps(run_dir: RunDir) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir.metrics)]


@pytest.mark.long
def test_killed_launcher_leaves_no_rank_and_its_lock_refuses_then_yields(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    first = _train(run_dir, "--steps", "3000", "--checkpoint-every", "3")
    try:
        _wait_steps(run_dir, first, 4)
        ranks = wait_ranks(first, 2)
        second = _train(run_dir, "--resume", "--steps", "3000")
        assert second.finish(120) == 2, second.output[-3000:]
        assert f"is in use by pid {first.proc.pid} on host" in second.output
        assert "Traceback" not in second.output
        os.kill(first.proc.pid, signal.SIGKILL)
        assert_all_gone(ranks)
    finally:
        first.cleanup()
    resumed_from = max(_steps(run_dir))  # nothing runs on: the metrics stand still
    time.sleep(1)
    assert max(_steps(run_dir)) == resumed_from
    third = _train(run_dir, "--resume", "--steps", str(resumed_from + 3))
    try:
        assert third.finish() == 0, third.output[-4000:]
    finally:
        third.cleanup()
    assert f"taking over the stale lock of pid {first.proc.pid}" in third.output
    steps = _steps(run_dir)
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] == resumed_from + 3


@pytest.mark.long
def test_a_killed_rank_restarts_from_the_newest_checkpoint_keeping_the_metrics(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    cli = _train(run_dir, "--steps", "14", "--checkpoint-every", "4", "--max-restarts", "1")
    try:
        _wait_steps(run_dir, cli, 6)
        rank1 = next(r for r in wait_ranks(cli, 2) if r.environ().get("RANK") == "1")
        rank1.kill()
        assert cli.finish() == 0, cli.output[-4000:]
    finally:
        cli.cleanup()
    assert "rank 1 failed (exit code 137): restarting all ranks (restart 1 of 1)" in cli.output
    assert "already committed" not in cli.output
    assert _steps(run_dir) == list(range(1, 15))
    assert json.loads(run_dir.summary.read_text())["status"] == "finished"
    assert verify(run_dir.checkpoints / "step-00000014").step == 14


def test_sigterm_saves_and_says_so(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    cli = _train(run_dir, "--steps", "3000", "--checkpoint-every", "1000")
    code = _stop_midway(run_dir, cli, lambda ranks: cli.proc.send_signal(signal.SIGTERM))
    assert code == 143, cli.output[-4000:]
    stopped = json.loads(run_dir.summary.read_text())["steps"]
    assert f"stopped by SIGTERM: checkpoint of step {stopped} written" in cli.output
    assert verify(run_dir.checkpoints / f"step-{stopped:08d}").step == stopped
    assert _steps(run_dir) == list(range(1, stopped + 1))
    # a damaged final model file: generate falls back to the newest valid checkpoint
    data = run_dir.final_model.read_bytes()
    run_dir.final_model.write_bytes(data[: len(data) // 2])
    out = Cli("generate", str(run_dir.root), "--tokens", "10")
    assert out.finish(120) == 0, out.output[-3000:]
    assert f"{run_dir.final_model} is damaged" in out.output
    assert f"# weights of step {stopped} from {run_dir.checkpoints}" in out.output


def test_sighup_without_grace_kills_and_says_no_checkpoint(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    cli = _train(run_dir, "--steps", "3000", "--checkpoint-every", "1000", "--grace-period-s", "0")
    code = _stop_midway(run_dir, cli, lambda ranks: cli.proc.send_signal(signal.SIGHUP))
    assert code == 137, cli.output[-4000:]
    assert "stopped by SIGHUP; the ranks did not finish within the grace period" in cli.output
    assert "no checkpoint was written (the run has none)" in cli.output
    assert not list(run_dir.checkpoints.glob("step-*"))


def test_sigint_to_one_rank_stops_all_after_the_same_step_with_130(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    cli = _train(run_dir, "--steps", "3000", "--checkpoint-every", "1000")

    def sigint_rank_1(ranks: list[psutil.Process]) -> None:
        next(r for r in ranks if r.environ().get("RANK") == "1").send_signal(signal.SIGINT)

    assert _stop_midway(run_dir, cli, sigint_rank_1) == 130, cli.output[-4000:]
    summary = json.loads(run_dir.summary.read_text())
    assert summary["status"] == "stopped by SIGINT"
    assert f"stopped by SIGINT: checkpoint of step {summary['steps']} written" in cli.output
    assert verify(run_dir.checkpoints / f"step-{summary['steps']:08d}").step == summary["steps"]
    assert "Traceback" not in cli.output
