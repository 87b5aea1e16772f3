"""``Engine.save_pretrained``: a Hugging Face directory from any layout that ``transformers``
loads with the engine's logits, streamed one tensor at a time."""

from __future__ import annotations

import export_cases as ec
import pytest

from shardwise.testing import run_on_ranks

pytest.importorskip("transformers")


def _bounded(results: list[dict]) -> None:
    """No rank held more than one output file's tensors: each rank's peak of live output
    tensors is at most the largest file written (in fact one tensor at a time)."""
    largest = results[0]["largest_file"]
    for r in results:
        assert 0 <= r["peak"] <= largest, (r["peak"], largest)
    assert len(results[0]["files"]) > 1  # sharded: several files and an index


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_one_process(tmp_path, kind):
    results = run_on_ranks(1, ec.export_dp, kind, 0, str(tmp_path), timeout_s=300)
    _bounded(results)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_dp2_zero3(tmp_path, kind):
    results = run_on_ranks(2, ec.export_dp, kind, 3, str(tmp_path), timeout_s=300)
    _bounded(results)


def test_hsdp_zero3(tmp_path):
    # 2 replicas x 2 shards: each parameter gathered within its shard group
    results = run_on_ranks(4, ec.export_dp, "llama", 3, str(tmp_path), 2, timeout_s=300)
    _bounded(results)


@pytest.mark.parametrize("stage", [1, 3])
def test_dp2_tp2_llama(tmp_path, stage):
    # tp pieces joined and the vocabulary padding (37 over tp2) cut
    results = run_on_ranks(4, ec.export_dp_tp, stage, str(tmp_path), timeout_s=300)
    _bounded(results)


@pytest.mark.parametrize("world,stage", [(2, 0), (4, 3)])
def test_pp2_llama(tmp_path, world, stage):
    # each tensor gathered on its stage and sent to the writer
    results = run_on_ranks(world, ec.export_pp, stage, str(tmp_path), timeout_s=300)
    _bounded(results)
    assert all(r["peak"] > 0 for r in results)  # every stage gathered tensors it owns


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)])
def test_pipeline_ranks_hold_their_stage_only(world, tp):
    # the GPT recipe (as `shardwise train --pp` applies it): after the caller drops the GPT,
    # each rank's live parameters are its stage's own
    results = run_on_ranks(world, ec.stage_only_bytes, 2, tp, timeout_s=300)
    for r in results:
        assert 0 < r["live"] < r["whole"] // tp
    # the tied embedding/head lives on both stages (each uses it), nothing else is shared
    assert all(r["tied"] == ["tok_emb"] for r in results)


def test_lora_adapter_and_merged(tmp_path):
    pytest.importorskip("peft")
    results = run_on_ranks(2, ec.export_lora, 3, str(tmp_path), timeout_s=300)
    adapter = results[0]["adapter"]
    assert adapter and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in adapter)
    # 2 layers x (q, v) x (A, B)
    assert len(adapter) == 8
    assert not any("lora" in n or "base_layer" in n for n in results[0]["merged"])


def test_lora_adapter_and_merged_from_dp2_tp2(tmp_path):
    """Adapters split over tp (B of q, v and the vocabulary-padded lm_head column-split, A of
    o and down row-split) are joined on export: the adapter and the merged model reload with
    the engine's logits."""
    pytest.importorskip("peft")
    targets = ("q_proj", "v_proj", "o_proj", "down_proj", "lm_head")
    results = run_on_ranks(4, ec.export_lora, 3, str(tmp_path), 2, targets, timeout_s=300)
    # 2 layers x 4 modules x (A, B) + lm_head's pair
    assert len(results[0]["adapter"]) == 18
    assert not any("lora" in n or "base_layer" in n for n in results[0]["merged"])


def test_checkpoint_export_hf_cli(tmp_path):
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    from shardwise.hf.checkpoint_export import export_checkpoint
    from shardwise.hf.stream_file import HeldBytes

    want = run_on_ranks(4, ec.checkpoint_dp_tp, str(tmp_path), timeout_s=300)[0]
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "shardwise.cli.main", "checkpoint", "export"]
    cmd += [str(tmp_path / "ckpt"), "--hf", str(out), "--config", str(tmp_path / "src")]
    done = subprocess.run([*cmd, "--max-shard-size", "12KB"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "file(s) to" in done.stdout
    model = AutoModelForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        got = model(ec._tokens()).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # streamed: one tensor alive at a time, never more than the largest file
    held = HeldBytes()
    plan = export_checkpoint(tmp_path / "ckpt", tmp_path / "again", ec.SHARD, held=held)
    largest = max(sum(ec.spec_bytes(t) for t in specs) for _, specs in plan.files)
    assert 0 < held.peak <= max(ec.spec_bytes(t) for _, s in plan.files for t in s) <= largest
