"""``shardwise plan --measure --run-top`` on one CUDA device: the ranks calibrated on NCCL, the
best layouts of the built-in GPT run on the GPU, predicted against measured; skipped without
a CUDA device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]


def test_plan_measure_runs_the_top_layouts_on_one_gpu():
    cmd = [sys.executable, "-m", "shardwise.cli.main", "plan", "--measure", "--model", "small",
           "--devices", "1", "--global-batch", "16", "--auto-budget-s", "20", "--top", "5",
           "--run-top", "3", "--run-steps", "5"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
    print(out.stdout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "calibrated in" in out.stdout and "ms per micro-batch" in out.stdout
    table = out.stdout.split("pred# meas#")[1].splitlines()[1:4]
    assert sorted(line.split()[1] for line in table) == ["1", "2", "3"]
    for line in table:
        predicted, measured = (float(v) for v in line.split()[-3:-1])
        assert predicted > 0 and measured > 0


def test_finetune_auto_on_one_gpu(tmp_path):
    """``shardwise finetune --demo --auto`` on one GPU: calibrated on the Hugging Face model's
    own step, the chosen layout fine-tuned, predicted beside measured in ``summary.json``."""
    import json

    cmd = [sys.executable, "-m", "shardwise.cli.main", "finetune", "--demo", str(tmp_path),
           "--nproc-per-node", "1", "--auto", "--auto-budget-s", "20", "--steps", "12",
           "--precision", "bf16"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
    print(out.stdout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "shardwise finetune --auto: calibrated in" in out.stdout
    plan = json.loads((tmp_path / "run" / "summary.json").read_text())["plan"]
    print("finetune --auto on one GPU: predicted", plan["predicted"]["step_time_s"],
          "measured", plan["measured"]["step_time_s"], "error", plan["error"])  # fmt: skip
    assert plan["predicted"]["step_time_s"] > 0 and plan["measured"]["step_time_s"] > 0
