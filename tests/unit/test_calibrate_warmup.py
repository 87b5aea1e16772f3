"""The compute probe's warm-up rule: steps run until two consecutive timings agree within a few
percent, so a cold start (a fresh process's first steps) never sets the compute rate."""

from __future__ import annotations

import pytest

from shardwise.costmodel.calibrate_ranks import WARM_TOLERANCE, warmed_up


def _warm_after(times: list[float]) -> int | None:
    """How many steps the probe's warm-up runs over ``times`` (None: never warm)."""
    for n in range(1, len(times) + 1):
        if warmed_up(times[:n]):
            return n
    return None


def test_one_timing_or_none_is_never_warm():
    assert not warmed_up([])
    assert not warmed_up([0.1])


def test_a_cold_start_runs_until_two_timings_agree():
    # a fresh pool: the first step 20x slower, then settling
    assert _warm_after([2.0, 0.9, 0.3, 0.1, 0.102, 0.101]) == 5
    assert _warm_after([0.1, 0.1]) == 2  # already warm: two steps


def test_agreement_is_relative_to_the_smaller_timing():
    assert WARM_TOLERANCE == 0.05
    assert warmed_up([1.0, 1.04])  # within 5%, either order
    assert warmed_up([1.04, 1.0])
    assert not warmed_up([1.0, 1.06])
    assert not warmed_up([1.06, 1.0])
    assert warmed_up([1.0, 1.2], tolerance=0.2)
    assert warmed_up([0.0, 0.0])


def test_only_the_last_two_timings_count():
    assert not warmed_up([0.1, 0.1, 0.5])  # warm, then a slow outlier: not yet again
    assert _warm_after([0.5, 0.1, 0.3, 0.1, 0.2]) is None


@pytest.mark.parametrize("slow", [2.0, 10.0, 100.0])
def test_a_single_slow_first_step_is_left_out(slow):
    assert _warm_after([slow, 0.1, 0.1]) == 3
