"""A rank dies (SIGKILL) mid-training; the elastic launcher restarts the job, which resumes from
its last checkpoint and ends with exactly the weights of a run without the failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "elastic_train.py"
TIMEOUT_S = 240


def _launch(tmp: Path, name: str, kill_at_step: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "shardwise.cli.main", "run", "--nproc-per-node", "2",
           "--max-restarts", "1", str(SCRIPT), "--checkpoint-dir", str(tmp / name / "ckpt"),
           "--out", str(tmp / name / "final.pt"), "--kill-at-step", str(kill_at_step)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


@pytest.mark.long
def test_killed_rank_restarts_and_resumes_to_identical_weights(tmp_path):
    # both jobs at once: each spends most of its time starting processes
    runs = {"killed": _launch(tmp_path, "killed", 5), "clean": _launch(tmp_path, "clean", -1)}
    logs = {}
    for name, proc in runs.items():
        try:
            logs[name], _ = proc.communicate(timeout=TIMEOUT_S)
        finally:
            proc.kill()
        assert proc.returncode == 0, f"{name} run failed:\n{logs[name][-4000:]}"
    killed = logs["killed"]
    assert "killing this rank (SIGKILL) before step 5" in killed, killed[-4000:]
    assert "loaded step 4" in killed, killed[-4000:]  # the restart resumed from step 4
    assert "loaded step" not in logs["clean"]
    assert "no checkpoint" in logs["clean"]
    want = torch.load(tmp_path / "clean" / "final.pt", weights_only=True)
    got = torch.load(tmp_path / "killed" / "final.pt", weights_only=True)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    steps = sorted(p.name for p in (tmp_path / "killed" / "ckpt").iterdir()
                   if p.name.startswith("step-"))
    assert steps == ["step-00000002", "step-00000004", "step-00000006"]
