"""What every ``--auto`` run directory must show, for the train and finetune tests: the plan
chosen and run, predicted beside measured in ``metrics.jsonl`` and ``summary.json``; the pinned
flags held by the run and by every layout shown."""

from __future__ import annotations

import json
from typing import Any

from shardwise.bytesize import format_bytes
from shardwise.train.metrics import read_metrics
from shardwise.train.plan_check import PLAN_NAME, TERMS, WARMUP_STEPS
from shardwise.train.rundir import RunDir


def check_recorded(run_dir: RunDir, steps: int, global_batch: int) -> dict[str, Any]:
    """The run took ``plan.json``'s layout and recorded its prediction and measurements;
    returns ``summary.json``'s ``plan``."""
    plan = json.loads((run_dir.root / PLAN_NAME).read_text())
    assert 1 <= len(plan["top"]) <= 5 and plan["fitting"] <= plan["searched"]
    config = json.loads(run_dir.config.read_text())
    settings = plan["settings"]
    assert config["derived"]["global_batch_size"] == global_batch == plan["global_batch"]
    assert (config["train"]["tp"], config["train"]["pp"]) == (settings["tp"], settings["pp"])
    assert config["shardwise"]["zero_stage"] == settings["zero"]
    predicted = plan["predicted"]["step_time_s"]
    records = read_metrics(run_dir.metrics)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["predicted_step_time_s"] == predicted for r in records)
    got = json.loads(run_dir.summary.read_text())["plan"]
    assert got["layout"] == plan["layout"]["describe"] and got["predicted"] == plan["predicted"]
    assert got["measured"]["steps_compared"] == list(range(WARMUP_STEPS + 1, steps + 1))
    assert set(got["measured"]["terms_s"]) == set(TERMS) and got["missed_most"] in TERMS
    assert got["error"] == got["measured"]["step_time_s"] / predicted - 1
    assert len(got["measured"]["memory_model_states_bytes_per_rank"]) == 2
    return got


def check_pinned(run_dir: RunDir) -> None:
    """A run given ``--tp 2 --zero 1 --micro-batch 2`` with ``--auto`` kept them."""
    config = json.loads(run_dir.config.read_text())
    assert config["train"]["tp"] == 2 and config["shardwise"]["zero_stage"] == 1
    assert config["shardwise"]["micro_batch_size"] == 2
    plan = json.loads((run_dir.root / PLAN_NAME).read_text())
    assert plan["pins"] == {"tp": 2, "zero": 1, "micro_batch": 2}
    for row in plan["top"]:
        assert " tp2 " in row["layout"] and " zero1 " in row["layout"]


def check_printed_top(stdout: str, run_dir: RunDir) -> None:
    """The table ``--auto`` printed before running: ``plan.json``'s best five (at most), each
    with its predicted step, memory per rank and breakdown, the first one run."""
    plan = json.loads((run_dir.root / PLAN_NAME).read_text())
    rows = stdout.split("breakdown):\n", 1)[1].split("running #1:", 1)[0].splitlines()
    assert len(rows) == len(plan["top"]), rows
    for i, (line, top) in enumerate(zip(rows, plan["top"], strict=True), 1):
        assert line.split()[0] == str(i) and top["layout"] in line, line
        assert f"{top['step_time_s']:.3f}" in line, line
        assert format_bytes(top["memory_bytes_per_rank"]["total"]) in line, line
        shown = {k: v for k, v in top["breakdown_s"].items() if v > 5e-4}  # terms over 0.5 ms
        assert shown and line.endswith(" ".join(f"{k} {v * 1e3:.0f}ms" for k, v in shown.items()))
    assert f"running #1: {plan['top'][0]['layout']}" in stdout
