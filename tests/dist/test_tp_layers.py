"""Vocab-parallel cross-entropy and plan validation on real ranks."""

from __future__ import annotations

import pytest
import tp_cases as tc

from shardwise.testing import run_on_ranks


@pytest.mark.parametrize("tp_size,vocab", [(2, 37), (4, 37), (4, 40)])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore", [False, True])
def test_vocab_parallel_cross_entropy(tp_size, vocab, smoothing, ignore):
    got = run_on_ranks(tp_size, tc.ce_parity, tp_size, vocab, smoothing, ignore)[0]
    tok = tc.BATCH * tc.SEQ * 4
    fwd = got["fwd"]
    assert set(fwd) == {"all_reduce"} and fwd["all_reduce"]["calls"] == 3
    # max, target logit (and the logit sum under smoothing), sum of exponentials
    assert fwd["all_reduce"]["bytes"] == (4 if smoothing else 3) * tok
    assert got["bwd"] == {}


def test_bad_plans_fail_at_parallelize_naming_the_module():
    run_on_ranks(4, tc.bad_plans, 4)
