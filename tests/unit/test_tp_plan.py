"""Plan patterns, shard math with padding and the RNG streams, in one process."""

from __future__ import annotations

import pytest
import torch

from shardwise.mesh import Axis
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.pipeline import LayerStack
from shardwise.parallel.placement import AxisPlace, Placement, Shard
from shardwise.parallel.plans.gpt import pipeline_layers, pipeline_tp_plan, tp_plan
from shardwise.parallel.tensor import rng
from shardwise.parallel.tensor.plan import expand, resolve


def test_brace_patterns_expand():
    assert expand("a.{q,k, v}_proj") == ["a.q_proj", "a.k_proj", "a.v_proj"]
    assert expand("{a,b}.{c,d}") == ["a.c", "a.d", "b.c", "b.d"]
    assert expand("plain.*") == ["plain.*"]


def test_gpt_plan_resolves_every_layer():
    model = GPT(GPTConfig(vocab_size=37, seq_len=8, n_layer=2, n_head=4, d_model=16))
    styles = resolve(model, tp_plan())
    assert styles["blocks.1.attn.v_proj"] == "colwise"
    assert styles["blocks.0.mlp.fc_out"] == "rowwise"
    assert styles["tok_emb"] == "vocab_embedding" and styles["head"] == "colwise"
    assert sum(s == "sequence" for s in styles.values()) == 3 + 3 * 2  # pos, drop, ln_f; blocks
    with pytest.raises(ValueError, match="allowed styles"):
        resolve(model, {"head": "columnwise"})
    with pytest.raises(TypeError, match="module-name patterns"):
        resolve(model, {3: "colwise"})


def test_gpt_pipeline_plan_names_the_pipeline_layers_like_tp_plan_the_gpt():
    # the same modules get the same styles under the pipeline's names (layers.{i}, tied.{key})
    model = GPT(GPTConfig(vocab_size=37, seq_len=8, n_layer=3, n_head=4, d_model=16))
    whole = resolve(model, tp_plan())
    stack = LayerStack(pipeline_layers(model))
    styles = resolve(stack, pipeline_tp_plan(model.cfg))
    modules = dict(stack.named_modules())
    by_module = {id(m): n for n, m in model.named_modules()}
    got = {by_module[id(modules[name])]: style for name, style in styles.items()}
    assert got == {n: s for n, s in whole.items() if n != "head"}  # the head is the tied embedding
    assert styles["tied.tok_emb"] == "vocab_embedding" and styles["layers.5"] == "sequence"
    unmatched: list[str] = []
    resolve(stack, {"layers.*.mlp.fc_in": "colwise", "layers.9.ln": "sequence"}, unmatched)
    assert unmatched == ["layers.9.ln"]


@pytest.mark.parametrize("n,tp", [(10, 4), (9, 4), (8, 4), (37, 2)])
def test_padded_shards_reassemble(n, tp):
    full = torch.arange(n * 3, dtype=torch.float32).view(n, 3)
    places = [Placement("w", (n, 3), (AxisPlace(Axis.TP, Shard(0), tp, r),)) for r in range(tp)]
    shards = [p.shard_of(full) for p in places]
    chunk = -(-n // tp)
    assert all(s.shape == (chunk, 3) == p.local_shape() for s, p in zip(shards, places))
    assert torch.equal(torch.cat(shards)[:n], full)
    real = sum(p.real_box()[1][0] for p in places)
    assert real == n and places[0].padded == (n % tp != 0)
    assert [p.real_box()[0][0] for p in places] == [min(r * chunk, n) for r in range(tp)]
    with pytest.raises(ValueError, match="expected the whole tensor"):
        places[0].shard_of(full[:-1])


def test_rng_streams():
    torch.manual_seed(5)
    with rng.fork(0):
        a = torch.rand(8)
    after_a = torch.rand(4)
    torch.manual_seed(5)
    with rng.fork(1):
        b = torch.rand(8)
    after_b = torch.rand(4)
    assert not torch.equal(a, b)  # each tp rank its own stream
    assert torch.equal(after_a, after_b)  # the replicated stream continues alike
    torch.manual_seed(5)
    state = rng.rng_state()
    with rng.fork(0):
        again = torch.rand(8)
    assert torch.equal(a, again)  # replayed from the same generator state
    rng.set_rng_state(state)
    with rng.fork(0):
        assert torch.equal(torch.rand(8), a)
    assert rng.mix(1, 2) != rng.mix(2, 1)
