"""``shardwise train --auto`` end to end on 2 gloo ranks through the CLI: the ranks calibrated,
a layout chosen and trained, predicted beside measured in ``metrics.jsonl`` and
``summary.json``; pinned flags respected; a model no layout holds refused in one line; and
``shardwise plan --measure --run-top``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from shardwise.cli.main import main
from shardwise.train.metrics import read_metrics
from shardwise.train.plan_check import PLAN_NAME, TERMS, WARMUP_STEPS
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
    plan = json.loads((run_dir.root / PLAN_NAME).read_text())
    assert 1 <= len(plan["top"]) <= 5 and plan["fitting"] <= plan["searched"]
    config = json.loads(run_dir.config.read_text())
    settings = plan["settings"]
    assert config["derived"]["global_batch_size"] == 8 == plan["global_batch"]
    assert (config["train"]["tp"], config["train"]["pp"]) == (settings["tp"], settings["pp"])
    assert config["shardwise"]["zero_stage"] == settings["zero"]
    predicted = plan["predicted"]["step_time_s"]
    records = read_metrics(run_dir.metrics)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(r["predicted_step_time_s"] == predicted for r in records)
    summary = json.loads(run_dir.summary.read_text())
    got = summary["plan"]
    assert got["layout"] == plan["layout"]["describe"] and got["predicted"] == plan["predicted"]
    assert got["measured"]["steps_compared"] == list(range(WARMUP_STEPS + 1, 9))
    assert set(got["measured"]["terms_s"]) == set(TERMS) and got["missed_most"] in TERMS
    assert got["error"] == got["measured"]["step_time_s"] / predicted - 1
    assert len(got["measured"]["memory_model_states_bytes_per_rank"]) == 2
    assert main(["report", str(run_dir.root)]) == 0
    assert (run_dir.report / "prediction.png").read_bytes()[:4] == b"\x89PNG"


def test_auto_respects_pinned_flags(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    out = _cli("train", *AUTO, "--steps", "2", "--tp", "2", "--zero", "1", "--micro-batch", "2",
               "--run-dir", str(run_dir.root))  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    config = json.loads(run_dir.config.read_text())
    assert config["train"]["tp"] == 2 and config["shardwise"]["zero_stage"] == 1
    assert config["shardwise"]["micro_batch_size"] == 2
    plan = json.loads((run_dir.root / PLAN_NAME).read_text())
    assert plan["pins"] == {"tp": 2, "zero": 1, "micro_batch": 2}
    for row in plan["top"]:
        assert " tp2 " in row["layout"] and " zero1 " in row["layout"]


def test_auto_refuses_a_model_no_layout_holds_in_one_line(tmp_path):
    out = _cli("train", *AUTO, "--seq-len", "40000000", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no layout of the tiny model" in lines[0], out.stderr
    assert "the smallest needs" in lines[0] and "GiB per rank" in lines[0]
    assert re.search(r"it would fit on \d+ such ranks|no count of such ranks", lines[0])
    assert "calibrated" not in out.stdout  # refused before measuring anything
    assert not (tmp_path / "run").exists()


def test_plan_measure_runs_the_top_layouts():
    out = _cli("plan", "--measure", "--model", "tiny", "--devices", "2", "--global-batch", "4",
               "--auto-budget-s", "4", "--top", "3", "--run-top", "2", "--run-steps", "2")  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "calibrated in" in out.stdout and "searched" in out.stdout
    table = out.stdout.split("pred# meas#")[1].splitlines()[1:]
    assert sorted(line.split()[1] for line in table[:2]) == ["1", "2"]
    assert "fastest measured: #" in out.stdout and "rank correlation" in out.stdout
