"""peft LoRA layers under a tensor-parallel plan: the base split as its style says, the
adapters split to match (B column-split under a column base, A row-split under a row base),
with and without sequence parallelism; gradients equal one process's, slice by slice."""

from __future__ import annotations

import lora_tp_cases as lc
import pytest
import torch

from shardwise.testing import run_on_ranks

pytest.importorskip("peft")


@pytest.mark.parametrize("sp", [False, True])
def test_lora_llama_tp2_parity(sp: bool) -> None:
    # vocab 37: lm_head's B carries the vocabulary padding, like its base
    losses = run_on_ranks(2, lc.lora_parity, 2, 37, sp, timeout_s=300)
    assert losses[0] == losses[1]
    assert losses[0] != pytest.approx(losses[0][0])


@pytest.mark.parametrize("sp", [False, True])
def test_lora_dropout_under_tp_keeps_replicas_equal(sp: bool) -> None:
    """The dropout before a whole A draws the same mask on every tp rank when its input is the
    same there (the replicated A stays equal, bit for bit); before a row-split A, or under SP on
    a rank's own tokens, each rank draws its own."""
    results = run_on_ranks(2, lc.replicas_with_dropout, 2, sp, timeout_s=300)
    first, second = results
    assert first["replicated"] and first["replicated"].keys() == second["replicated"].keys()
    for name, value in first["replicated"].items():
        assert torch.equal(second["replicated"][name], value), f"{name} differs across tp"
    assert torch.equal(first["masks"]["q_proj"], second["masks"]["q_proj"])
    assert not torch.equal(first["masks"]["o_proj"], second["masks"]["o_proj"])
    # the gate's input: the whole sequence on every rank, or under SP this rank's tokens
    assert torch.equal(first["masks"]["gate_proj"], second["masks"]["gate_proj"]) != sp
