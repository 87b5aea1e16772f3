"""``shardwise train --cp 2`` end to end on 2 gloo ranks: the same losses as one process
(every rank holds half of each sequence, attention exact over both), and layouts cp cannot
split refused in one line."""

from __future__ import annotations

import json

import pytest
from test_train_e2e import _train

from shardwise.estimate import estimate_activations
from shardwise.models.gpt import GPTConfig
from shardwise.train.metrics import read_metrics
from shardwise.train.rundir import RunDir

STEPS = ["--steps", "4", "--eval-every", "2", "--checkpoint-every", "0", "--micro-batch", "4"]


def _losses(run_dir: RunDir) -> list[tuple[float, float | None]]:
    return [(r["loss"], r.get("val_loss")) for r in read_metrics(run_dir.metrics)]


@pytest.mark.parametrize("method", ["ring", pytest.param("all_to_all", marks=pytest.mark.long)])
def test_train_cp2_matches_one_process(tmp_path, method):
    one, cp = RunDir(tmp_path / "one"), RunDir(tmp_path / "cp")
    out = _train(*STEPS, "--nproc-per-node", "1", "--run-dir", str(one.root))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    out = _train(*STEPS, "--cp", "2", "--cp-method", method, "--run-dir", str(cp.root))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "(cp2)" in out.stdout
    want, got = _losses(one), _losses(cp)
    assert len(got) == 4
    for (loss, val), (want_loss, want_val) in zip(got, want):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert (val is None) == (want_val is None)
        assert val is None or val == pytest.approx(want_val, rel=1e-5)
    op = "send" if method == "ring" else "all_to_all"
    assert all(r["comm"][op]["bytes"] > 0 for r in read_metrics(cp.metrics))
    # the summary's estimate: a cp rank's activations are those of seq / 2 tokens, and the
    # model states it measured are the estimate's (ZeRO-0: nothing sharded or padded)
    memory = json.loads(cp.summary.read_text())["memory"]
    tiny = GPTConfig.named("tiny")
    est = memory["estimated_per_rank"]
    assert est["activations"] == estimate_activations(tiny, 4, tiny.seq_len // 2, "fp32")
    assert est["activations"] * 2 == estimate_activations(tiny, 4, tiny.seq_len, "fp32")
    assert all(m["model_states"] == est["model_states"]
               for m in memory["measured_peak_per_rank"])  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cp", "3"], "--cp 3 does not divide the 2 ranks"),
        (["--cp", "2", "--seq-len", "30"], "the sequence length 30 must divide by 4"),
        (["--cp", "2", "--cp-method", "ulysses"], "--cp-method must be one of ring, all_to_all"),
    ],
)
def test_train_refuses_a_layout_cp_cannot_split(tmp_path, args, message):
    out = _train(*STEPS, *args, "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()
