"""A Hugging Face LlamaForCausalLM, built from a tiny config, trains under tp like one process."""

from __future__ import annotations

import pytest
import tp_cases as tc

from shardwise.testing import run_on_ranks

pytest.importorskip("transformers")


@pytest.mark.parametrize("tp_size,vocab", [(2, 37), (4, 37), (4, 40)])
def test_llama_parity_adamw(tp_size, vocab):
    losses = run_on_ranks(tp_size, tc.llama_parity, tp_size, vocab, timeout_s=600)
    assert all(row == losses[0] for row in losses)


@pytest.mark.parametrize("tp_size,vocab", [(2, 37), (4, 40)])
def test_llama_sequence_parallel_parity(tp_size, vocab):
    # positions and the causal mask come from the embedding's (whole) output; the region
    # starts at the first decoder layer, the norms run on 1/tp of the sequence
    losses = run_on_ranks(tp_size, tc.llama_parity, tp_size, vocab, True, timeout_s=600)
    assert all(row == losses[0] for row in losses)


@pytest.mark.parametrize("stage,sp", [(0, False), (1, False), (2, True), (3, False), (3, True)])
def test_llama_dp2_tp2_zero_parity(stage, sp):
    run_on_ranks(4, tc.engine_parity, 2, 2, stage, sp, kind="llama", timeout_s=600)


def test_a_sequence_module_before_the_entry_is_refused():
    run_on_ranks(2, tc.llama_norm_before_entry, timeout_s=300)
