"""Resume on real gloo ranks when the newest checkpoint is damaged (it is set aside and training
continues past it to the same weights as an uninterrupted run) or the journal is lost (rebuilt
from the manifests)."""

from __future__ import annotations

import ckpt_cases as cc
import torch

from shardwise.checkpoint import verify
from shardwise.checkpoint.journal import Journal
from shardwise.checkpoint.layout import step_dir_name
from shardwise.testing import run_on_ranks


def test_damaged_step_is_set_aside_and_training_continues_past_it(tmp_path):
    root = tmp_path / "c"
    results = run_on_ranks(2, cc.set_aside_and_continue, str(root))
    for out in results:
        assert out["resumed_from"] == 2
        assert out["rebuilt_step"] == 4
        for name, want in out["reference"].items():
            assert torch.equal(out["continued"][name], want), name
            assert torch.equal(out["rebuilt"][name], want), name
    aside = root / "damaged-step-00000003"
    assert (aside / cc.DAMAGED_FILE["flip"]).is_file()  # kept for inspection, with the reason
    assert "does not verify" in (aside / "SET_ASIDE.txt").read_text()
    assert "wrong checksum" in (aside / "SET_ASIDE.txt").read_text()
    on_disk = sorted(int(p.name[5:]) for p in root.glob("step-*"))
    assert Journal(root).read().live_steps() == on_disk[-3:] == [2, 3, 4]  # rebuilt; keep_last 3
    for step in (3, 4):  # saved again past the damaged one
        assert verify(root / step_dir_name(step)).step == step
