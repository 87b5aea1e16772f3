"""peft LoRA layers under a tensor-parallel plan: the base split as its style says, the
adapters split to match (B column-split under a column base, A row-split under a row base),
with and without sequence parallelism; gradients equal one process's, slice by slice."""

from __future__ import annotations

import lora_tp_cases as lc
import pytest

from shardwise.testing import run_on_ranks

pytest.importorskip("peft")


@pytest.mark.parametrize("sp", [False, True])
def test_lora_llama_tp2_parity(sp: bool) -> None:
    # vocab 37: lm_head's B carries the vocabulary padding, like its base
    losses = run_on_ranks(2, lc.lora_parity, 2, 37, sp, timeout_s=300)
    assert losses[0] == losses[1]
    assert losses[0] != pytest.approx(losses[0][0])
