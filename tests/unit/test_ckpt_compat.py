"""A checkpoint of format version 1 (written by an earlier shardwise, tests/fixtures/ckpt_v1)
still loads: its flat ranges are read as boxes, its pickled rank states are never unpickled."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardwise
from shardwise.checkpoint import CheckpointError, CheckpointReader, verify
from shardwise.models import GPT, GPTConfig

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1"
CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=8, bias=False)


@pytest.fixture
def v1(tmp_path: Path) -> Path:
    """A copy of the fixture's checkpoint root (loading never writes, but a copy is cheap)."""
    root = tmp_path / "checkpoints"
    shutil.copytree(FIXTURE / "checkpoints", root)
    return root


def _expected(prefix: str) -> dict[str, torch.Tensor]:
    full = load_file(str(FIXTURE / "expected.safetensors"))
    return {k[len(prefix) :]: v for k, v in full.items() if k.startswith(prefix)}


def test_reader_reads_every_tensor_of_format_1(v1: Path) -> None:
    report = verify(v1)
    assert report.format_version == 1 and report.world_size == 2
    stored = _expected("stored/")
    with CheckpointReader(v1) as reader:
        assert reader.names() == sorted(stored)
        for name, want in stored.items():
            assert torch.equal(reader.read_full(name), want), name
            flat = want.reshape(-1)
            lo, hi = flat.numel() // 3, flat.numel() - 1  # a range across both ranks' pieces
            assert torch.equal(reader.read_range(name, lo, hi), flat[lo:hi]), name
        with pytest.raises(CheckpointError, match="format_version 1 stores rank states as pickles"):
            reader.rank_state(0)


def test_engine_loads_format_1_and_saves_format_2(
    v1: Path, tmp_path: Path, world_of_one: None, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = shardwise.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        shardwise.Config(zero_stage=1, seed=3),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
    )
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        state = engine.load(v1)
    assert state["global_step"] == 2 and engine.global_step == 2
    assert "format_version 1 checkpoint" in caplog.text and "re-seeded" in caplog.text
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)
    loaded = engine.state_dict()
    for key, want in _expected("state/").items():
        assert torch.equal(loaded[key], want), key
    out = engine.save(tmp_path / "v2")
    with CheckpointReader(out) as reader:
        assert reader.manifest.format_version == 2
        for name, want in _expected("stored/").items():
            assert torch.equal(reader.read_full(name), want), name
        assert reader.rank_state(0)["torch"].dtype == torch.uint8
