"""``shardwise finetune`` end to end on 2 ranks: a run with a rank killed (-9) mid-run,
resumed, gives the uninterrupted run's losses bit for bit (LoRA, LoRA at tp 2 and full,
packing); a LoRA checkpoint holds no base weight; the adapter / model reload in peft /
transformers with the run's logits; bad input is refused in one line with nothing written."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launcher_procs import Cli, wait_ranks

from shardwise.sft import demo

safetensors_torch = pytest.importorskip("safetensors.torch")
load_file, save_file = safetensors_torch.load_file, safetensors_torch.save_file

pytest.importorskip("peft")
SRC = str(Path(__file__).resolve().parents[2] / "src")
LORA = "r=4,alpha=8,dropout=0.0,targets=q_proj,v_proj"
TP_LORA = "r=4,alpha=8,dropout=0.0,targets=q_proj,k_proj,v_proj,o_proj,gate_proj,down_proj,lm_head"
EMB_LORA = "r=4,alpha=8,dropout=0.0,targets=embed_tokens,q_proj"
BAD_TENSOR = "model.layers.0.mlp.up_proj.weight"


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    cmd = [sys.executable, "-m", "shardwise.cli.main", "finetune", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ftcli")
    llama = demo.model_dir(root, "llama")
    demo.write_jsonl(root / "chat.jsonl", demo.chat_records(24))
    # broken copies of the model directory, for the bad-input cases
    shutil.copytree(llama, root / "alien")
    config = json.loads((root / "alien" / "config.json").read_text())
    (root / "alien" / "config.json").write_text(json.dumps({**config, "model_type": "nosuch"}))
    shutil.copytree(llama, root / "notok")
    (root / "notok" / "tokenizer.json").unlink()
    shutil.copytree(llama, root / "nochat")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (root / "nochat" / f).unlink(missing_ok=True)
    demo.tokenizer(chat=False).save_pretrained(root / "nochat")
    shutil.copytree(llama, root / "badshape")  # one tensor of the wrong shape for its name
    weights = root / "badshape" / "model.safetensors"
    tensors = load_file(weights)
    tensors[BAD_TENSOR] = tensors[BAD_TENSOR][:, :-1].clone()
    save_file(tensors, weights, metadata={"format": "pt"})
    long = {"prompt": " ".join(["the quick brown fox"] * 40), "completion": " dog"}
    demo.write_jsonl(root / "masked.jsonl", [long] * 8)
    return root


def _losses(run: Path, key: str = "loss") -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)[key] for line in lines if line.strip()]


COMMON = ("--seq-len", "64", "--micro-batch", "2", "--zero", "3", "--lr", "1e-2")
STEPS = 6


def _killed_mid_run(root: Path, args: tuple[str, ...], run: str) -> None:
    """Start ``args`` with every checkpoint save stalled, SIGKILL rank 1 once step 3 is
    recorded (mid-run, maybe mid-save); the launcher exits non-zero."""
    env = {"PYTHONPATH": SRC, "SHARDWISE_CKPT_STALL_S": "1"}
    cli = Cli("finetune", *args, "--run-dir", str(root / run), extra_env=env)
    metrics = root / run / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(_losses(root / run)) >= 3):
            assert cli.proc.poll() is None and time.monotonic() < deadline, cli.output[-3000:]
            time.sleep(0.05)
        rank1 = next(r for r in wait_ranks(cli, 2) if r.environ().get("RANK") == "1")
        rank1.send_signal(signal.SIGKILL)
        assert cli.finish() != 0, cli.output[-3000:]
    finally:
        cli.cleanup()
    assert len(_losses(root / run)) < STEPS


@pytest.mark.parametrize(
    "how",
    [
        # every case runs in CI's long step (tens of seconds each)
        pytest.param(("--lora", LORA), marks=pytest.mark.long),
        pytest.param(("--full",), marks=pytest.mark.long),
        pytest.param(
            ("--lora", TP_LORA, "--tp", "2", "--grad-accum", "2"), marks=pytest.mark.long
        ),
    ],
)
def test_killed_run_resumes_bitwise_and_outputs_reload(root: Path, how: tuple[str, ...]) -> None:
    name = "-".join(h.strip("-") for h in how if h.startswith("--"))
    args = (str(root / "llama"), "--data", str(root / "chat.jsonl"), *how, "--packing", *COMMON)
    args += ("--checkpoint-every", "2", "--steps", str(STEPS))
    whole = _cli(root, *args, "--run-dir", f"whole-{name}")
    assert whole.returncode == 0, whole.stderr[-2000:]
    _killed_mid_run(root, args, f"part-{name}")
    resumed = _cli(root, "--run-dir", f"part-{name}", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _losses(root / f"part-{name}") == _losses(root / f"whole-{name}")
    # the outputs reload in peft / transformers with the final checkpoint's weights
    from transformers import AutoModelForCausalLM

    from shardwise.checkpoint import CheckpointReader
    from shardwise.checkpoint.tools import read_consolidated

    run = root / f"whole-{name}"
    step_dir = run / "checkpoints" / f"step-{STEPS:08d}"
    state = read_consolidated(step_dir)
    x = torch.tensor([[3, 40, 41, 42, 4, 5]])
    if how[0] == "--lora":
        from peft import PeftModel

        from shardwise.sft.lora import LoraSpec, apply_lora

        # the checkpoint holds the adapters and their optimizer states, no base weight
        with CheckpointReader(step_dir, verify=False) as reader:
            stored = [n for n in reader.names() if n.startswith(("model/", "optim/"))]
        assert stored and all(".lora_A." in n or ".lora_B." in n for n in stored)
        base = AutoModelForCausalLM.from_pretrained(root / "llama")
        loaded = PeftModel.from_pretrained(base, run / "adapter").eval()
        mine = apply_lora(AutoModelForCausalLM.from_pretrained(root / "llama"), LoraSpec.parse(how[1]))
        assert set(state) < set(mine.state_dict())
        mine.load_state_dict(state, strict=False)
        assert (run / "adapter" / "tokenizer.json").is_file()
    else:
        loaded = AutoModelForCausalLM.from_pretrained(run / "model").eval()
        mine = AutoModelForCausalLM.from_pretrained(root / "llama")
        mine.load_state_dict(state)
        assert (run / "model" / "tokenizer.json").is_file()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, mine.eval()(x).logits, rtol=0, atol=1e-6)


@pytest.mark.long
def test_lora_at_tp2_follows_dp2_and_its_outputs_reload(root: Path) -> None:
    """``--lora --tp 2`` (adapters split with their layers) takes the steps of the same global
    batch at dp 2 (losses and gradient norms); the joined adapter loads in peft with the merged model's logits and the
    checkpoint's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardwise.checkpoint.tools import read_consolidated
    from shardwise.sft.lora import LoraSpec, apply_lora

    args = (str(root / "llama"), "--data", str(root / "chat.jsonl"), "--lora", TP_LORA, *COMMON)
    args += ("--steps", "4", "--checkpoint-every", "4")
    dp2 = _cli(root, *args, "--run-dir", "lora-dp2")
    assert dp2.returncode == 0, dp2.stderr[-2000:]
    tp2 = _cli(root, *args, "--tp", "2", "--grad-accum", "2", "--merge", "--run-dir", "lora-tp2")
    assert tp2.returncode == 0, tp2.stderr[-2000:]
    for key in ("loss", "grad_norm"):  # the norm: each adapter counted once (clipped at 1)
        want = _losses(root / "lora-dp2", key)
        assert _losses(root / "lora-tp2", key) == pytest.approx(want, rel=1e-5)
    run = root / "lora-tp2"
    x = torch.tensor([[3, 40, 41, 42, 4, 5]])
    base = AutoModelForCausalLM.from_pretrained(root / "llama")
    adapter = PeftModel.from_pretrained(base, run / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(run / "model").eval()
    mine = apply_lora(AutoModelForCausalLM.from_pretrained(root / "llama"), LoraSpec.parse(TP_LORA))
    mine.load_state_dict(read_consolidated(run / "checkpoints" / "step-00000004"), strict=False)
    with torch.no_grad():
        want = adapter(x).logits
        torch.testing.assert_close(mine.eval()(x).logits, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(merged(x).logits, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("llama", "--data", "chat.jsonl", "--lora", LORA, "--full"), "choose one of"),
        (("llama", "--data", "chat.jsonl", "--lora", "r=4,targets=nope"), "match no module"),
        (("nowhere", "--data", "chat.jsonl", "--full"), "has no config.json"),
        (("llama", "--data", "empty.jsonl", "--full"), "holds no example"),
        (("llama", "--data", "chat.jsonl", "--full", "--merge"), "needs --lora"),
        (("alien", "--data", "chat.jsonl", "--full"), "model type transformers does not know"),
        (("llama", "--data", "chat.jsonl", "--lora", EMB_LORA, "--tp", "2"), "'model.embed_tokens"),
        (("notok", "--data", "chat.jsonl", "--full"), "has no tokenizer.json"),
        (("nochat", "--data", "chat.jsonl", "--full"), "the tokenizer has no chat template"),
        (("llama", "--data", "masked.jsonl", "--full", "--seq-len", "64"), "all its labels masked"),
        (("badshape", "--data", "chat.jsonl", "--lora", LORA), f"{BAD_TENSOR} (stored as"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(root: Path, args, message) -> None:
    (root / "empty.jsonl").write_text("\n")
    out = _cli(root, *args, "--run-dir", "bad")
    assert out.returncode == 2
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (root / "bad").exists()


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    cmd = [sys.executable, "-m", "shardwise.cli.main", "generate", *args, "--tokens", "6"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.long
def test_demo_finetunes_and_generate_reads_runs_and_model_dirs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shardwise.cli.main", "finetune", "--demo", str(tmp_path)]
        + ["--steps", "2", "--merge", "--micro-batch", "2"],
        env={**os.environ, "PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    run = tmp_path / "run"
    assert (run / "adapter" / "adapter_config.json").is_file()
    assert len(_losses(run)) == 2
    # the demo tokenizer was trained on the bundled corpus (Python source): it merges code
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    code = "    return self"
    assert len(tok) == 512 and len(tok(code, add_special_tokens=False)["input_ids"]) <= 4
    for target, extra in ((run, ["--chat"]), (run / "model", []), (tmp_path / "model", [])):
        got = _generate(str(target), "--prompt", "the quick", "--temperature", "0", *extra)
        assert got.returncode == 0, got.stderr[-2000:]
        assert "# weights from" in got.stderr and got.stdout.strip()


def test_finetune_function_refuses_bad_input_like_the_command(root: Path) -> None:
    from shardwise import finetune

    run = root / "bad-fn"
    with pytest.raises(ValueError, match="choose one of"):
        finetune(root / "llama", root / "chat.jsonl", lora=LORA, full=True, run_dir=run)
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        finetune(root / "notok", root / "chat.jsonl", full=True, run_dir=run)
    assert not run.exists()
