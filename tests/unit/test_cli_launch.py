"""``shardwise run``: options, errors and a real 2-rank launch of the hello example."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardwise.cli.main", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def test_run_hello_on_two_ranks():
    out = _cli("run", "--nproc-per-node", "2", "examples/hello.py")
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "rank 0/2" in text and "rank 1/2" in text and "= 3 (expected 3)" in text


def test_bad_launch_options_are_one_line():
    out = _cli("run", "--nproc-per-node", "0", "examples/hello.py")
    assert out.returncode == 2
    assert out.stderr.strip() == "shardwise run: error: --nproc-per-node must be >= 1, got 0"
    out = _cli("run", "--nnodes", "2", "examples/hello.py")
    assert out.returncode == 2 and "--rdzv-endpoint" in out.stderr
