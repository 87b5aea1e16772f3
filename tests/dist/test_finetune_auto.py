"""``shardwise finetune --auto`` end to end on 2 gloo ranks through the CLI: the ranks calibrated
on the Hugging Face model's own step, a layout chosen and fine-tuned (LoRA), predicted beside
measured in ``metrics.jsonl`` and ``summary.json``; pinned flags respected; a model no layout
holds refused in one line before anything is measured."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from auto_checks import check_pinned, check_printed_top, check_recorded

from shardwise.sft import demo
from shardwise.train.plan_check import PLAN_NAME
from shardwise.train.rundir import RunDir

pytest.importorskip("peft")
ROOT = Path(__file__).resolve().parents[2]
LORA = "r=4,alpha=8,dropout=0.0,targets=q_proj,v_proj"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ftauto")
    return demo.model_dir(root, "llama"), demo.write_jsonl(root / "chat.jsonl", demo.chat_records())


def _cli(model: Path, data: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "shardwise.cli.main", "finetune", str(model), "--data", str(data),
           "--lora", LORA, "--seq-len", "48", "--nproc-per-node", "2", "--auto",
           "--auto-budget-s", "5", *args]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_finetune_auto_chooses_trains_and_records_predicted_and_measured(inputs, tmp_path):
    run_dir = RunDir(tmp_path / "run")
    out = _cli(*inputs, "--steps", "8", "--global-batch", "8", "--run-dir", str(run_dir.root))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "shardwise finetune --auto: calibrated in" in out.stdout
    got = check_recorded(run_dir, 8, 8)
    check_printed_top(out.stdout, run_dir)
    plan = json.loads((run_dir.root / PLAN_NAME).read_text())
    settings = plan["settings"]
    assert (settings["pp"], settings["cp"], settings["sequence_parallel"]) == (1, 1, False)
    config = json.loads(run_dir.config.read_text())
    assert config["finetune"]["lora"] == LORA  # still a fine-tuning run of the directory
    assert config["shardwise"]["micro_batch_size"] == settings["micro_batch"]
    recompute = config["shardwise"]["activation_checkpointing"]
    assert recompute == (["LlamaDecoderLayer"] if settings["activation_checkpointing"] else None)
    # the frozen base is priced as weights only: the states predicted are the adapters' states
    # plus the base's weights, as the engine holds them
    held = got["measured"]["memory_model_states_bytes_per_rank"]
    assert plan["predicted"]["memory_bytes_per_rank"]["states"] == pytest.approx(max(held), rel=0.1)
    assert (run_dir.root / "adapter" / "adapter_config.json").is_file()


@pytest.mark.long
def test_finetune_auto_respects_pinned_flags(inputs, tmp_path):
    run_dir = RunDir(tmp_path / "run")
    out = _cli(*inputs, "--steps", "2", "--tp", "2", "--zero", "1", "--micro-batch", "2",
               "--run-dir", str(run_dir.root))  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    check_pinned(run_dir)


def test_finetune_auto_refuses_a_model_no_layout_holds_in_one_line(inputs, tmp_path):
    model, data = inputs
    # a context of 40M tokens (rotary positions: nothing allocated for it): one sequence's
    # attention is beyond any number of ranks
    long = shutil.copytree(model, tmp_path / "long")
    config = json.loads((long / "config.json").read_text())
    (long / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1 << 26}))
    out = subprocess.run(
        [sys.executable, "-m", "shardwise.cli.main", "finetune", str(long), "--data", str(data),
         "--lora", LORA, "--seq-len", "40000000", "--auto", "--run-dir", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no layout of the long model" in lines[0], out.stderr
    assert "the smallest needs" in lines[0] and "per rank" in lines[0]
    assert re.search(r"it would fit on \d+ such ranks|no count of such ranks", lines[0])
    assert "calibrated" not in out.stdout  # refused before measuring anything
    assert not (tmp_path / "run").exists()


def test_finetune_auto_is_refused_on_resume(inputs, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "shardwise.cli.main", "finetune", "--resume", "--auto",
         "--run-dir", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "shardwise finetune: error: --auto chooses a new run's layout: a resumed run keeps its own"
    )
