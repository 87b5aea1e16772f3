"""Per-rank parameter counts and Korthikanti et al.'s activation formulas under tp."""

from __future__ import annotations

import pytest

from shardwise.costmodel import tp_memory as tpe
from shardwise.mesh import Axis
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.placement import AxisPlace, Placement, Shard


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("vocab", [37, 40])
def test_gpt_params_per_rank_match_the_plan(tp, vocab):
    cfg = GPTConfig(vocab_size=vocab, seq_len=8, n_layer=2, n_head=4, d_model=16)
    model = GPT(cfg)
    split = ("tok_emb", "q_proj", "k_proj", "v_proj", "fc_in", "out_proj.weight", "fc_out.weight")
    sharded = replicated = 0
    for name, p in model.named_parameters():
        if any(k in name for k in split):
            dim = 1 if name.endswith(("out_proj.weight", "fc_out.weight")) else 0
            place = AxisPlace(Axis.TP, Shard(dim), tp, 0)
            local = Placement(name, tuple(p.shape), (place,)).local_shape()
            n = 1
            for x in local:
                n *= x
            sharded += n
        else:
            replicated += p.numel()
    assert tpe.gpt_params_per_rank(cfg, tp) == (sharded, replicated)
    if tp == 1:
        assert sharded + replicated == cfg.param_count()


def test_korthikanti_formulas():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B shape, as in the paper's Table 2
    sbh = s * b * h
    assert tpe.layer_activation_bytes(s, b, h, a) == sbh * (34 + 5 * a * s // h)
    t = 8
    assert tpe.layer_activation_bytes(s, b, h, a, t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    sp = tpe.layer_activation_bytes(s, b, h, a, t, sequence_parallel=True)
    assert sp == sbh * (34 + 5 * a * s / h) / t
    assert tpe.layer_activation_bytes(s, b, h, a, t, True, "selective") == 34 * sbh // t
    assert tpe.layer_activation_bytes(s, b, h, a, t, True, "full") == 2 * sbh // t
    assert tpe.layer_activation_bytes(s, b, h, a, t, False, "full") == 2 * sbh
    with pytest.raises(ValueError, match="recompute"):
        tpe.layer_activation_bytes(s, b, h, a, t, recompute="some")
