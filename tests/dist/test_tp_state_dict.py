"""A tensor-parallel engine's ``state_dict()`` is the single-process model (vocabulary padding
cut) and ``load_state_dict`` of a full state keeps each rank's piece."""

from __future__ import annotations

import pytest
import tp_state_cases as tsc

from shardwise.testing import run_on_ranks


@pytest.mark.parametrize("stage", [0, 3])
def test_dp2_tp2_full_state_dict_equals_one_process_and_loads(stage):
    run_on_ranks(4, tsc.state_dict_round_trip, 2, 2, stage, timeout_s=600)


@pytest.mark.parametrize("stage", [0, 3])
def test_tp2_full_state_dict_equals_one_process_and_loads(stage):
    run_on_ranks(2, tsc.state_dict_round_trip, 1, 2, stage, timeout_s=600)
