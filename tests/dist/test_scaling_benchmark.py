"""``benchmarks/scaling.py`` end to end on the tiny GPT at 1 and 2 ranks: every system's row has
its measurement beside the model's prediction, the bytes each system sends per step are the ones
ZeRO's formulas give, and the JSON and the PNG are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.models.gpt import GPTConfig

REPO = Path(__file__).resolve().parents[2]
SYSTEMS = {"dp", "zero3", "tp", "pp"}


pytestmark = pytest.mark.long  # a minute of benchmark runs: CI runs it in its long step


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("scaling")
    argv = [sys.executable, str(REPO / "benchmarks" / "scaling.py"), "--model", "tiny",
            "--ranks", "1,2", "--rounds", "1", "--steps", "1", "--warmup", "0",
            "--sync-segments-ms", "2,5", "--json", str(out / "s.json"),
            "--png", str(out / "s.png")]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((out / "s.json").read_text()), out / "s.png", done.stdout


def test_every_system_is_measured_beside_its_prediction(report):
    data, png, stdout = report
    rows = {(r["system"], r["ranks"]): r for r in data["rows"]}
    assert set(rows) == {(s, n) for s in SYSTEMS for n in (1, 2)}
    seq = GPTConfig.named("tiny").seq_len
    for (_, n), r in rows.items():
        assert r["step_s"] > 0 and r["predicted_step_s"] > 0
        assert 0 <= r["exposed_comm_share"] <= 1
        # weak scaling: 2 sequences per rank (tp and pp run all of them through every rank)
        tokens = 2 * seq * n
        assert r["tokens_per_s"] * r["step_s"] == pytest.approx(tokens)
        if n == 1:  # the one-rank step is the calibration: efficiency 1, predicted exactly
            assert r["efficiency"] == pytest.approx(1.0)
            assert r["predicted_step_s"] == pytest.approx(r["step_s"])
    assert rows["tp", 2]["predicted_breakdown"]["tp"] > 0
    assert rows["pp", 2]["predicted_breakdown"]["bubble"] > 0
    assert data["allreduce_busbw_gbs"]["2"] > 0
    assert "sync loss" in stdout and "2 one-rank steps at once" in stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bytes_per_step_follow_zero(report):
    data = report[0]
    rows = {(r["system"], r["ranks"]): r for r in data["rows"]}
    grads = GPTConfig.named("tiny").param_count() * 4  # fp32, a multiple of 2 ranks
    zero3 = rows["zero3", 2]["bytes_per_step"]
    assert zero3["reduce_scatter"] == grads  # gradients once
    assert zero3["all_gather"] == 2 * grads  # parameters for forward and for backward
    assert grads <= rows["dp", 2]["bytes_per_step"]["all_reduce"] < grads + 64  # + the used map
