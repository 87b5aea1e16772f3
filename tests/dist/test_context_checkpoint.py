"""A checkpoint saved at one context-parallel layout loads at any other: the GPT saved at
dp2 x cp2 (ZeRO-3) continues at dp2 x cp2 bit for bit, and at cp4 (ZeRO-1), dp4 and one
process within fp32 rounding (the sums run in another order), losses and final weights."""

from __future__ import annotations

import cp_ckpt_cases as ck
import pytest
import torch

from shardwise.testing import run_on_ranks


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("cp_ckpt") / "ckpt")
    out = run_on_ranks(4, ck.save_and_continue, root, timeout_s=600)
    return root, out[0]


def _close(got: dict, want: dict) -> None:
    torch.testing.assert_close(got["after"], want["after"], rtol=1e-5, atol=1e-6)
    assert got["state"].keys() == want["state"].keys()
    for name, t in want["state"].items():
        torch.testing.assert_close(got["state"][name], t, rtol=1e-5, atol=1e-6, msg=name)


def test_same_cp_layout_continues_bit_for_bit(saved) -> None:
    root, want = saved
    for got in run_on_ranks(4, ck.load_and_continue, root, 2, 2, 3, timeout_s=600):
        assert got["after"] == want["after"]
        for name, t in want["state"].items():
            assert torch.equal(got["state"][name], t), name


@pytest.mark.parametrize(
    ("world", "dp", "cp", "stage"), [(4, 1, 4, 1), (2, 1, 2, 0), (4, 4, 1, 2), (1, 1, 1, 0)]
)
def test_cp_checkpoint_loads_at_another_layout(saved, world, dp, cp, stage) -> None:
    root, want = saved
    for got in run_on_ranks(world, ck.load_and_continue, root, dp, cp, stage, timeout_s=600):
        _close(got, want)
