"""Engine checkpoints on real gloo ranks: exact resume, N -> M resharding across stages and
precisions, damaged checkpoints, async saves, export to the plain model."""

from __future__ import annotations

from pathlib import Path

import ckpt_cases as cc
import numpy as np
import pytest
import torch
import zero_cases as zc
from safetensors.torch import load_file

from shardwise.checkpoint import CheckpointReader
from shardwise.checkpoint import export_consolidated
from shardwise.testing import run_on_ranks

RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("stage", [0, 3])
def test_resume_is_bitwise_identical(tmp_path, stage):
    # scheduler, two param groups and a data sampler are restored as well
    for whole, first, resumed in run_on_ranks(2, cc.resume_bitwise, stage, str(tmp_path / "c")):
        whole_state, whole_losses, whole_lr = whole
        state, losses, lr = resumed
        assert first[1] == whole_losses[:2]
        assert losses == whole_losses[2:]
        assert lr == whole_lr
        for k, v in whole_state.items():
            assert torch.equal(state[k], v), k


# (save world, load world, save stage, load stage, optimizer, frozen first layer)
RESHARD = [
    (2, 3, 0, 3, "adamw", False),
    (4, 2, 3, 1, "adamw_groups", True),
    (3, 1, 2, 0, "sgd", True),
    (1, 4, 1, 2, "adamw", False),
]


@pytest.mark.parametrize(
    "n,m,stage_a,stage_b,opt,frozen",
    RESHARD,
    ids=[f"{c[0]}to{c[1]}-stage{c[2]}to{c[3]}-{c[4]}" for c in RESHARD],
)
def test_reshard_matches_uninterrupted_reference(tmp_path, n, m, stage_a, stage_b, opt, frozen):
    root, k, steps = str(tmp_path / "c"), 2, 4
    ref_losses, ref_state, _ = zc.reference("gpt", opt, cc.PARTS, steps, 1, None, frozen)
    first = run_on_ranks(n, cc.save_phase, stage_a, opt, frozen, root, k)
    second = run_on_ranks(m, cc.load_phase, stage_b, opt, frozen, root, steps)
    torch.testing.assert_close(
        torch.tensor(first[0]), torch.tensor(ref_losses[:k]), rtol=RTOL, atol=ATOL
    )
    for losses, state, start in second:
        assert start == k
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses[k:]), rtol=RTOL, atol=ATOL
        )
        assert state.keys() == ref_state.keys()
        for name, v in ref_state.items():
            torch.testing.assert_close(
                state[name], v, rtol=RTOL, atol=ATOL, msg=lambda msg, name=name: f"{name}: {msg}"
            )


def test_precision_change_keeps_fp32_masters_and_states(tmp_path):
    root = tmp_path / "c"
    for saved, loaded in run_on_ranks(2, cc.precision_change, str(root)):
        for k, v in saved.items():
            assert torch.equal(loaded[k], v), k
    with CheckpointReader(root / "bf16") as a, CheckpointReader(root / "fp32") as b:
        assert a.names() == b.names()
        assert any(n.startswith("optim/") for n in a.names())
        for name in a.names():
            assert a.dtype(name) == torch.float32 or not name.startswith("model/")
            assert torch.equal(a.read_full(name), b.read_full(name)), name
        assert a.trainer_state["precision"] == "bf16"
        assert (
            b.trainer_state["optimizer"]["scalar_states"]
            == a.trainer_state["optimizer"]["scalar_states"]
        )


def test_damaged_checkpoints_are_refused_and_resume_falls_back(tmp_path):
    kinds = ["flip", "delete", "truncate"]
    results = run_on_ranks(2, cc.damaged, str(tmp_path / "c"), kinds)
    for rank, out in enumerate(results):
        for how in kinds:
            got = out[how]
            assert got["refused"] is not None, (how, got)
            assert "step-00000003" in got["refused"] and got["file"] in got["refused"], got
            assert got["resumed_step"] == 2 and got["global_step"] == 2, got
            if rank == 0:
                text = "\n".join(got["log"])
                assert "WARNING" in text and got["file"] in text, text  # the reason
                assert "fell back" in text and "step-00000003" in text, text
                assert "step-00000002" in text, text
        assert out["none"] is None


def test_async_save_writes_the_same_files_and_training_goes_on(tmp_path):
    results = run_on_ranks(2, cc.async_vs_sync, str(tmp_path))
    committed, sync_state, async_state = results[0]
    assert Path(committed) == tmp_path / "async" / "step-00000002"
    for k, v in sync_state.items():
        assert torch.equal(async_state[k], v), k
    a, s = tmp_path / "async" / "step-00000002", tmp_path / "sync" / "step-00000002"
    files = sorted(p.name for p in s.iterdir() if p.name != "manifest.json")
    assert files == sorted(p.name for p in a.iterdir() if p.name != "manifest.json")
    assert any(f.startswith("shard-") for f in files)
    for name in files:
        if name.startswith("shard-"):
            assert (a / name).read_bytes() == (s / name).read_bytes(), name
        else:  # RNG states: equal values
            rank = int(name.removeprefix("rank-").removesuffix(".safetensors"))
            with CheckpointReader(a) as ra, CheckpointReader(s) as rs:
                got, want = ra.rank_state(rank), rs.rank_state(rank)
            assert got["python"] == want["python"], name
            assert torch.equal(got["torch"], want["torch"]), name
            assert all(np.array_equal(x, y) for x, y in zip(got["numpy"], want["numpy"]))
    with CheckpointReader(a) as ra, CheckpointReader(s) as rs:
        assert ra.names() == rs.names()
        for name in ra.names():
            assert torch.equal(ra.read_full(name), rs.read_full(name)), name


def test_export_equals_state_dict_loads_strictly_and_starts_an_engine(tmp_path):
    root = tmp_path / "c"
    state = run_on_ranks(2, cc.export_source, str(root))[0]
    out = tmp_path / "model.safetensors"
    names, _ = export_consolidated(root, out)
    exported = load_file(str(out))
    assert sorted(names) == sorted(state) == sorted(exported)
    assert "head.weight" in exported  # the tied alias of tok_emb.weight
    for k, v in state.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    model = zc.make_gpt()
    model.load_state_dict(exported, strict=True)
    assert model.head.weight is model.tok_emb.weight
    # and an engine starts from it: exported file, checkpoint dir, a dict without the alias
    untied = {k: v for k, v in exported.items() if k != "head.weight"}
    for got in run_on_ranks(2, cc.from_pretrained, 2, [str(out), str(root), untied])[0]:
        for k, v in state.items():
            assert torch.equal(got[k], v), k
