"""A model larger than a rank's memory limit trains from a sharded Hugging Face directory at
ZeRO-3 (#19): each rank runs under an ``RLIMIT_DATA`` below the full model's fp32 size and above
its final state plus one unit; the same model built whole on the rank fails under that limit."""

from __future__ import annotations

import sys

import limit_cases as lc
import pytest

from shardwise.testing import run_on_ranks

LAYERS, HIDDEN, WORLD = 64, 320, 4


@pytest.mark.long
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA and VmData")
def test_zero3_trains_under_a_data_limit_the_full_model_exceeds(tmp_path):
    pytest.importorskip("transformers")
    import torch
    from transformers import LlamaForCausalLM

    config = lc.llama_config(LAYERS, HIDDEN)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    full = sum(p.numel() for p in model.parameters()) * 4
    model.save_pretrained(tmp_path, max_shard_size="80MB", safe_serialization=True)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    unit = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers) * 4
    del model
    # final state per rank: its quarter of the parameters and of their gradients (SGD keeps
    # nothing else); beside it while training: two gathered units and one unit's gradients
    extra = int(full * 0.85)
    state = 2 * full // WORLD
    assert state + 3 * unit + 16 * lc.MiB < extra < full
    rows = run_on_ranks(
        WORLD,
        lc.train_under_limit,
        str(tmp_path),
        LAYERS,
        HIDDEN,
        extra,
        3,
        timeout_s=600,
        fresh=True,
    )
    for losses, held, peak, bound, full_error in rows:
        assert len(losses) == 3 and all(v == v for v in losses)
        assert losses[2] < losses[0]
        assert held < extra < full
        assert 0 < peak <= bound < extra
        assert "alloc" in full_error.lower() or "memory" in full_error.lower(), full_error
