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
