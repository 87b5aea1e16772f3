"""``shardwise finetune`` end to end on 2 ranks: the run directory, a resume that continues
the uninterrupted run's losses bit for bit, the adapter reloading in peft with the run's
logits, and bad input refused in one line with nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.finetune import demo

pytest.importorskip("peft")
SRC = str(Path(__file__).resolve().parents[2] / "src")
LORA = "r=4,alpha=8,dropout=0.0,targets=q_proj,v_proj"


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    cmd = [sys.executable, "-m", "shardwise.cli.main", "finetune", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ftcli")
    demo.model_dir(root, "llama")
    demo.write_jsonl(root / "chat.jsonl", demo.chat_records(24))
    return root


def _losses(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if line.strip()]


COMMON = ("--seq-len", "64", "--micro-batch", "2", "--zero", "3", "--lr", "1e-2")


@pytest.mark.parametrize("how", [("--lora", LORA), ("--full",)])
def test_resume_continues_bitwise_and_outputs_reload(root: Path, how: tuple[str, ...]) -> None:
    name = how[0].strip("-")
    args = ("llama", "--data", "chat.jsonl", *how, "--packing", *COMMON, "--checkpoint-every", "2")
    whole = _cli(root, *args, "--steps", "4", "--run-dir", f"whole-{name}")
    assert whole.returncode == 0, whole.stderr[-2000:]
    part = _cli(root, *args, "--steps", "2", "--run-dir", f"part-{name}")
    assert part.returncode == 0, part.stderr[-2000:]
    resumed = _cli(root, "--run-dir", f"part-{name}", "--resume", "--steps", "4")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _losses(root / f"part-{name}") == _losses(root / f"whole-{name}")
    # the outputs reload in peft / transformers with the final checkpoint's weights
    from transformers import AutoModelForCausalLM

    from shardwise.checkpoint.tools import read_consolidated

    run = root / f"whole-{name}"
    state = read_consolidated(run / "checkpoints" / "step-00000004")
    x = torch.tensor([[3, 40, 41, 42, 4, 5]])
    if name == "lora":
        from peft import PeftModel

        from shardwise.finetune.lora import LoraSpec, apply_lora
        from shardwise.finetune.model import build_model, check_model_dir

        base = AutoModelForCausalLM.from_pretrained(root / "llama")
        loaded = PeftModel.from_pretrained(base, run / "adapter").eval()
        mine = apply_lora(build_model(check_model_dir(root / "llama")), LoraSpec.parse(LORA))
    else:
        loaded = AutoModelForCausalLM.from_pretrained(run / "model").eval()
        mine = AutoModelForCausalLM.from_pretrained(root / "llama")
    mine.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, mine.eval()(x).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("llama", "--data", "chat.jsonl", "--lora", LORA, "--full"), "choose one of"),
        (("llama", "--data", "chat.jsonl", "--lora", "r=4,targets=nope"), "match no module"),
        (("nowhere", "--data", "chat.jsonl", "--full"), "has no config.json"),
        (("llama", "--data", "empty.jsonl", "--full"), "holds no example"),
        (("llama", "--data", "chat.jsonl", "--full", "--merge"), "needs --lora"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(root: Path, args, message) -> None:
    (root / "empty.jsonl").write_text("\n")
    out = _cli(root, *args, "--run-dir", "bad")
    assert out.returncode == 2
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (root / "bad").exists()
