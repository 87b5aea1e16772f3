"""Checkpoints across (dp, tp) layouts: saved at dp2 x tp2 ZeRO-3 (split parameters stored at
their whole, unpadded shape), loaded at tp4, at dp4 ZeRO-1 on a plain model and at one
process, training goes on as if never interrupted."""

from __future__ import annotations

import pytest
import torch
import tp_cases as tc
import tp_state_cases as tsc

from shardwise.checkpoint import CheckpointReader
from shardwise.testing import run_on_ranks


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("tp_ckpt") / "c")
    run_on_ranks(4, tsc.save_at, root, 2, 2, 3, timeout_s=600)
    return root


@pytest.fixture(scope="module")
def uninterrupted() -> tuple[list[float], dict[str, torch.Tensor]]:
    ref, losses = tsc.reference(tsc.SAVED_AT + tsc.MORE)
    return losses, ref.state_dict()


def test_saved_tensors_have_the_whole_unpadded_shapes(saved):
    torch.manual_seed(0)
    plain = tsc.GPT(tc.gpt_config(vocab=tsc.VOCAB))
    with CheckpointReader(saved) as reader:
        for name, p in plain.named_parameters():
            assert reader.global_shape(f"model/{name}") == tuple(p.shape), name
        assert reader.trainer_state["world_size"] == 4 and reader.trainer_state["tp_size"] == 2


@pytest.mark.parametrize(
    "world, dp, tp_size, stage",
    [(4, 1, 4, 3), (4, 4, 1, 1), (1, 1, 1, 0)],
    ids=["tp4-zero3", "dp4-zero1-plain", "one-process"],
)
def test_dp2_tp2_zero3_checkpoint_continues_at_another_layout(
    saved, uninterrupted, world, dp, tp_size, stage
):
    losses, state = uninterrupted
    for out in run_on_ranks(world, tsc.load_and_continue, saved, dp, tp_size, stage, timeout_s=600):
        torch.testing.assert_close(
            torch.tensor(out["losses"]),
            torch.tensor(losses[tsc.SAVED_AT :]),
            rtol=tc.RTOL,
            atol=tc.ATOL,
        )
        assert out["state"].keys() == state.keys()
        for k, v in state.items():
            torch.testing.assert_close(
                out["state"][k], v, rtol=tc.RTOL, atol=tc.ATOL, msg=lambda m, k=k: f"{k}: {m}"
            )


def test_a_corrupted_shard_is_refused_naming_its_file(saved):
    file = "shard-00001-of-00004.safetensors"
    for msg in run_on_ranks(4, tsc.load_damaged, saved, file, timeout_s=600):
        assert file in msg and "step-00000002" in msg, msg


def test_one_process_checkpoint_continues_at_tp2(tmp_path, uninterrupted):
    losses, state = uninterrupted
    root = str(tmp_path / "c")
    run_on_ranks(1, tsc.save_at, root, 1, 1, 0, timeout_s=600)
    for out in run_on_ranks(2, tsc.load_and_continue, root, 1, 2, 3, 1, timeout_s=600):
        torch.testing.assert_close(
            torch.tensor(out["losses"]),
            torch.tensor(losses[tsc.SAVED_AT :]),
            rtol=tc.RTOL,
            atol=tc.ATOL,
        )
        for k, v in state.items():
            torch.testing.assert_close(out["state"][k], v, rtol=tc.RTOL, atol=tc.ATOL)


def test_the_load_names_every_rank_that_saved(saved):
    """Saved by dp2 x tp2: four ranks wrote it (not the two of dp), loaded at tp4 by four."""
    for line in run_on_ranks(4, tsc.load_message, saved, 1, 4, 3, timeout_s=600):
        assert "saved by 4 ranks, dp 2, at stage 3" in line, line
        assert "now 4 ranks, dp 1, at stage 3" in line, line
