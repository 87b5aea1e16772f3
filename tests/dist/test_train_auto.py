"""``shardwise train --auto`` end to end on 2 gloo ranks through the CLI: the ranks calibrated,
a layout chosen and trained, predicted beside measured in ``metrics.jsonl`` and
``summary.json``; pinned flags respected; a model no layout holds refused in one line; and
``shardwise plan --measure --run-top``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from auto_checks import check_pinned, check_printed_top, check_recorded

from shardwise.cli.main import main
from shardwise.train.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
AUTO = ["--nproc-per-node", "2", "--model", "tiny", "--max-bytes", "1000000", "--auto",
        "--auto-budget-s", "5", "--eval-every", "0"]  # fmt: skip


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "shardwise.cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)  # fmt: skip


def test_auto_chooses_trains_and_records_predicted_and_measured(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    out = _cli("train", *AUTO, "--steps", "8", "--global-batch", "8", "--run-dir",
               str(run_dir.root))  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "calibrated in" in out.stdout and "running #1:" in out.stdout
    check_recorded(run_dir, 8, 8)
    check_printed_top(out.stdout, run_dir)
    assert main(["report", str(run_dir.root)]) == 0
    assert (run_dir.report / "prediction.png").read_bytes()[:4] == b"\x89PNG"


def test_auto_respects_pinned_flags(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    out = _cli("train", *AUTO, "--steps", "2", "--tp", "2", "--zero", "1", "--micro-batch", "2",
               "--run-dir", str(run_dir.root))  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    check_pinned(run_dir)


def test_auto_refuses_a_model_no_layout_holds_in_one_line(tmp_path):
    out = _cli("train", *AUTO, "--seq-len", "40000000", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no layout of the tiny model" in lines[0], out.stderr
    assert "the smallest needs" in lines[0] and "GiB per rank" in lines[0]
    assert re.search(r"it would fit on \d+ such ranks|no count of such ranks", lines[0])
    assert "calibrated" not in out.stdout  # refused before measuring anything
    assert not (tmp_path / "run").exists()


@pytest.mark.long
def test_plan_measure_runs_the_top_layouts():
    out = _cli("plan", "--measure", "--model", "tiny", "--devices", "2", "--global-batch", "4",
               "--auto-budget-s", "4", "--top", "3", "--run-top", "2", "--run-steps", "2")  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "calibrated in" in out.stdout and "searched" in out.stdout
    table = out.stdout.split("pred# meas#")[1].splitlines()[1:]
    assert sorted(line.split()[1] for line in table[:2]) == ["1", "2"]
    assert "fastest measured: #" in out.stdout and "rank correlation" in out.stdout
