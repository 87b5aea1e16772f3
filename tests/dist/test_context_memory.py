"""Context parallelism keeps 1/cp of the activations: the bytes a cp rank's forward saves for
backward, measured tensor by tensor, are 1/cp of what the whole sequence saves (both methods:
attention keeps q, k, v and the log-sum-exp, never the scores), and equal the cost model's count
at seq / cp."""

from __future__ import annotations

import dataclasses

import cp_cases as cc
import pytest

from shardwise.costmodel.activations import gpt_saved_activation_bytes
from shardwise.testing import run_on_ranks

LOSS_SCALAR = 4  # the cross entropy's fp32 total weight: one per rank, whatever the tokens
BATCH = 2


@pytest.mark.parametrize("method", ["ring", "all_to_all"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_rank_saves_one_cp_th_of_the_activations(cp, method):
    out = run_on_ranks(cp, cc.saved_activation_bytes, method, BATCH, timeout_s=300)
    whole = out[0]["whole"]
    for r in out:
        assert (r["cp_rank"] - LOSS_SCALAR) * cp == whole - LOSS_SCALAR
    # the model's count (what estimate and the cost model use) at this rank's seq / cp tokens,
    # plus the vocab-parallel embedding's mask of the ids out of its range (a byte per token)
    seq = 8 * cp
    cfg = dataclasses.replace(cc.gpt_config(seq), vocab_size=64)
    local = gpt_saved_activation_bytes(cfg, BATCH, seq // cp)
    assert local * cp == gpt_saved_activation_bytes(cfg, BATCH, seq)
    assert out[0]["cp_rank"] == local + BATCH * seq // cp + LOSS_SCALAR
