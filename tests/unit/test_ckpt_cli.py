"""``shardwise checkpoint inspect | verify | export`` as subprocesses, on a checkpoint made in
this process by a world-size-1 engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardwise
from shardwise.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=16)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardwise.cli.main", "checkpoint", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(root, the engine's full state dict) after 2 steps at stage 0 on a world of one."""
    root = tmp_path_factory.mktemp("ckpt") / "run"
    torch.manual_seed(0)
    model = GPT(CFG)
    try:
        engine = shardwise.initialize(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            shardwise.Config(checkpoint_dir=str(root)),
        )
        tokens = torch.randint(
            0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=torch.Generator().manual_seed(1)
        )
        for _ in range(2):
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            engine.step()
        engine.save()
        state = engine.state_dict()
    finally:
        shardwise.shutdown()
    return root, state


def test_inspect_shows_layout_and_run(checkpoint):
    root, _ = checkpoint
    out = _cli("inspect", str(root))
    assert out.returncode == 0, out.stderr
    for text in (
        "step: 2",
        "world size: 1",
        "model/",
        "optim/",
        "verification: OK",
        "engine: global step 2, ZeRO stage 0, precision fp32",
        "head.weight",
    ):
        assert text in out.stdout, (text, out.stdout)


def test_export_loads_into_the_plain_model(checkpoint, tmp_path):
    root, state = checkpoint
    out_file = tmp_path / "model.safetensors"
    out = _cli("export", str(root / "step-00000002"), str(out_file))
    assert out.returncode == 0, out.stderr
    exported = load_file(str(out_file))
    assert sorted(exported) == sorted(state)
    for k, v in state.items():
        assert torch.equal(exported[k], v), k
    GPT(CFG).load_state_dict(exported, strict=True)


def test_verify_passes_then_fails_in_one_line(checkpoint, tmp_path):
    root, _ = checkpoint
    ok = _cli("verify", str(root))
    assert ok.returncode == 0 and ok.stdout.startswith("OK"), (ok.stdout, ok.stderr)
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", str(root), str(damaged)], check=True)
    shard = damaged / "step-00000002" / "shard-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    bad = _cli("verify", str(damaged))
    assert bad.returncode == 1
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAILED") and shard.name in lines[0], lines
    export = _cli("export", str(damaged), str(tmp_path / "x.safetensors"))
    assert export.returncode == 1 and shard.name in export.stderr
    assert not Path(tmp_path / "x.safetensors").exists()


def test_export_into_a_directory_and_into_a_missing_one(checkpoint, tmp_path):
    root, state = checkpoint
    out_dir = tmp_path / "some_dir"
    out_dir.mkdir()
    done = _cli("export", str(root), f"{out_dir}/")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out_dir.iterdir()) == ["model.safetensors"]
    assert sorted(load_file(str(out_dir / "model.safetensors"))) == sorted(state)
    assert not list(tmp_path.glob("*.tmp"))
    missing = _cli("export", str(root), str(tmp_path / "nowhere" / "m.safetensors"))
    lines = missing.stderr.strip().splitlines()
    assert missing.returncode == 2 and len(lines) == 1 and "nowhere" in lines[0], lines
    assert not (tmp_path / "nowhere").exists()
