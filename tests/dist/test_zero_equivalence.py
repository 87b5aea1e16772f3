"""ZeRO stages 0-3 train exactly like one process on the same global batch (fp32)."""

from __future__ import annotations

import pytest
import torch
import zero_cases as zc

from shardwise.testing import run_on_ranks

RTOL, ATOL = 1e-5, 1e-6


def _check(results, ref):
    ref_losses, ref_state, ref_norms = ref
    for losses, state, norms in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms),
                                   rtol=1e-4, atol=ATOL)
        assert state.keys() == ref_state.keys()
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gpt_tied_adamw(world, stage):
    args = ("gpt", "adamw", 3, 1, None, False)
    ref = zc.reference(args[0], args[1], world, *args[2:])
    _check(run_on_ranks(world, zc.train_on_rank, "gpt", "adamw", stage, *args[2:]), ref)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_clipping_param_groups(world, stage):
    # 4 micro-steps per step, clipping active (max norm below the gradients' norm)
    ref = zc.reference("gpt", "adamw_groups", world, 2, 4, 0.3, False)
    assert all(n > 0.3 for n in ref[2]), "clipping must be active in this test"
    _check(run_on_ranks(world, zc.train_on_rank, "gpt", "adamw_groups", stage, 2, 4, 0.3,
                        False), ref)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sgd_momentum_with_frozen_layer(world, stage):
    ref = zc.reference("gpt", "sgd", world, 3, 1, None, True)
    _check(run_on_ranks(world, zc.train_on_rank, "gpt", "sgd", stage, 3, 1, None, True), ref)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cnn_with_batchnorm(stage):
    ref = zc.reference("cnn", "adamw", 2, 3, 1, None, False)
    results = run_on_ranks(2, zc.train_on_rank, "cnn", "adamw", stage, 3, 1, None, False)
    ref_losses, ref_state, _ = ref
    for losses, state, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=RTOL, atol=ATOL)
        for k, v in ref_state.items():
            if "running" in k or "num_batches" in k:
                continue  # statistics of each rank's own part, as with torch DDP
            torch.testing.assert_close(state[k], v, rtol=RTOL, atol=ATOL)
