"""Tensor parallelism composed with the engine: ZeRO 0-3 over dp, clipping on the global norm."""

from __future__ import annotations

import pytest
import tp_cases as tc

from shardwise.testing import run_on_ranks


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dp2_tp2_zero_parity(stage):
    run_on_ranks(4, tc.engine_parity, 2, 2, stage, False, timeout_s=600)


@pytest.mark.parametrize("stage", [0, 3])
def test_dp2_tp2_sequence_parallel_zero_parity(stage):
    run_on_ranks(4, tc.engine_parity, 2, 2, stage, True, timeout_s=600)


def test_tp4_engine_with_recompute():
    run_on_ranks(4, tc.engine_parity, 1, 4, 2, True, True, timeout_s=600)
