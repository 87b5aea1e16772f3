"""Run directories through real ``shardwise train`` processes: a moved or copied run directory
uses only its own checkpoints; a lost journal is rebuilt on resume; the metrics are cut exactly
at the resumed step; a crashed resume leaves no stale summary, and the summary's wall time
spans every launch."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
from launcher_procs import TINY_TRAIN, Cli

from shardwise.checkpoint.journal import Journal
from shardwise.train.metrics import read_metrics
from shardwise.train.rundir import RunDir


def _train(run_dir: RunDir, *args: str, timeout: float = 300) -> str:
    cli = Cli("train", "--nproc-per-node", "2", *TINY_TRAIN, "--run-dir", str(run_dir.root), *args)
    try:
        code = cli.finish(timeout)
    finally:
        cli.cleanup()
    assert code == 0, cli.output[-4000:]
    return cli.output


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _steps(run_dir: RunDir) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir.metrics)]


def _checkpoints(run_dir: RunDir) -> list[int]:
    return Journal(run_dir.checkpoints).read().live_steps()


@pytest.mark.long
def test_moved_and_copied_run_dirs_use_only_their_own_checkpoints(tmp_path):
    first = RunDir(tmp_path / "first")
    _train(first, "--steps", "4", "--checkpoint-every", "2")
    assert json.loads(first.config.read_text())["shardwise"]["checkpoint_dir"] == "checkpoints"
    moved = RunDir(tmp_path / "moved")
    shutil.move(first.root, moved.root)
    out = _train(moved, "--resume", "--steps", "6")
    assert "loaded step 4" in out, out[-3000:]
    assert not first.root.exists()  # nothing written at the old place
    assert _steps(moved) == [1, 2, 3, 4, 5, 6] and _checkpoints(moved) == [2, 4, 6]

    copy = RunDir(tmp_path / "copy")
    shutil.copytree(moved.root, copy.root)
    before = _tree(moved.root)
    out = _train(copy, "--resume", "--steps", "10")
    assert "loaded step 6" in out, out[-3000:]
    assert _tree(moved.root) == before  # keep_last (3) retired only the copy's own steps
    assert _checkpoints(copy) == [6, 8, 10] and _steps(copy) == list(range(1, 11))
    assert sorted(p.name for p in copy.checkpoints.glob("step-*")) == [
        "step-00000006",
        "step-00000008",
        "step-00000010",
    ]


@pytest.mark.long
def test_lost_journal_crashed_resume_metrics_cut_and_summary(tmp_path):
    run = RunDir(tmp_path / "run")
    _train(run, "--steps", "6", "--checkpoint-every", "2")
    first_wall = json.loads(run.summary.read_text())["wall_time_s"]
    (run.checkpoints / "journal.log").unlink()

    crashing = Cli(
        "train",
        "--nproc-per-node",
        "2",
        *TINY_TRAIN,
        "--run-dir",
        str(run.root),
        "--resume",
        "--steps",
        "3000",
        "--checkpoint-every",
        "0",
    )
    try:
        deadline = time.monotonic() + 240
        while not (run.metrics.exists() and len(read_metrics(run.metrics)) >= 9):
            assert crashing.proc.poll() is None and time.monotonic() < deadline, crashing.output
            time.sleep(0.1)
        assert not run.summary.exists()  # the resumed launch discarded the old one at its start
    finally:
        crashing.cleanup()  # kill -9: the launch crashes
    assert "rebuilding it from their manifests" in crashing.output, crashing.output[-3000:]
    assert not run.summary.exists()  # no stale "finished at step 6"
    assert _checkpoints(run) == [2, 4, 6]  # the rebuilt journal
    crashed = read_metrics(run.metrics)
    assert [r["step"] for r in crashed] == list(range(1, len(crashed) + 1))
    assert crashed[-1]["wall_s"] > first_wall

    out = _train(run, "--resume", "--steps", "8")
    assert "loaded step 6" in out and "dropping" in out, out[-3000:]
    records = read_metrics(run.metrics)
    assert [r["step"] for r in records] == list(range(1, 9))  # cut exactly at 6, then 7, 8
    assert records[:6] == crashed[:6]  # nothing before the resumed step changed
    summary = json.loads(run.summary.read_text())
    assert summary["status"] == "finished" and summary["steps"] == 8
    assert summary["wall_time_s"] > crashed[-1]["wall_s"] > first_wall  # every launch counts
