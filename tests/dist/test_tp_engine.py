"""Tensor parallelism composed with the engine: ZeRO 0-3 over dp, clipping on the global norm."""

from __future__ import annotations

import pytest
import tp_cases as tc

from shardwise.testing import run_on_ranks
from shardwise.costmodel.tp_memory import gpt_params_per_rank


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dp2_tp2_zero_parity(stage):
    run_on_ranks(4, tc.engine_parity, 2, 2, stage, False, timeout_s=600)


@pytest.mark.parametrize("stage", [0, 3])
def test_dp2_tp2_sequence_parallel_zero_parity(stage):
    run_on_ranks(4, tc.engine_parity, 2, 2, stage, True, timeout_s=600)


def test_tp4_engine_with_recompute():
    run_on_ranks(4, tc.engine_parity, 1, 4, 2, True, True, timeout_s=600)


def test_bf16_and_offload_run_unchanged():
    run_on_ranks(4, tc.engine_parity, 2, 2, 2, True, precision="bf16", timeout_s=600)
    run_on_ranks(4, tc.engine_parity, 2, 2, 2, False, offload=True, timeout_s=600)


@pytest.mark.parametrize("stage", [0, 3])
def test_memory_per_rank_is_the_tp_shard_then_zero_over_dp(stage):
    # params at stage 0: this rank's tp shard (sharded layers / tp, replicated whole);
    # stage 3 divides that by dp (params and, here, the optimizer's two fp32 moments)
    results = run_on_ranks(4, tc.engine_parity, 2, 2, stage, False, timeout_s=600)
    held = sum(gpt_params_per_rank(tc.gpt_config(vocab=37), 2))
    dp = 2
    for r in results:
        mem = r["memory"]
        owned = held if stage == 0 else held / dp
        # flat buffers are padded to a multiple of dp per bucket: a few elements
        assert 4 * owned <= mem["params"] <= 4 * owned + 4 * 64 * dp, mem
        assert 8 * owned <= mem["optimizer"] <= 8 * owned + 8 * 64 * dp, mem
