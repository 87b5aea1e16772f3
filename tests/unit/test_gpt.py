"""The GPT model: sizes, tied head, shapes, initial loss, causality, generation."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.models import GPT, MODEL_SIZES, GPTConfig


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _tiny(**overrides: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.named("tiny", **overrides))


@pytest.mark.parametrize(("name", "expected"), [("anchor", 23_240_704), ("gpt2", 124_439_808)])
def test_named_sizes_param_count(name: str, expected: int) -> None:
    cfg = GPTConfig.named(name)
    with torch.device("meta"):  # shapes only: no memory, no init cost
        model = GPT(cfg)
    assert model.num_params() == expected
    assert cfg.param_count() == expected


@pytest.mark.parametrize("name", sorted(MODEL_SIZES))
def test_param_count_formula_matches_model(name: str) -> None:
    cfg = GPTConfig.named(name, bias=False)
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_params() == cfg.param_count()


def test_named_overrides_and_unknown_name() -> None:
    cfg = GPTConfig.named("small", dropout=0.1, seq_len=32)
    assert (cfg.d_model, cfg.seq_len, cfg.dropout) == (128, 32, 0.1)
    with pytest.raises(ValueError, match="tiny"):
        GPTConfig.named("huge")


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(vocab_size=256, seq_len=8, n_layer=1, n_head=3, d_model=64)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(vocab_size=256, seq_len=8, n_layer=0, n_head=1, d_model=64)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(vocab_size=256, seq_len=8, n_layer=1, n_head=1, d_model=64, dropout=1.0)


def test_head_weight_is_token_embedding() -> None:
    model = _tiny()
    assert model.head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names  # shared parameter is listed once


def test_init_is_deterministic_and_scaled() -> None:
    a, b = _tiny(), _tiny()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    block = a.blocks[0]
    assert torch.count_nonzero(block.attn.q_proj.bias) == 0
    residual_std = block.mlp.fc_out.weight.std().item()
    assert residual_std == pytest.approx(0.02 / math.sqrt(2 * a.cfg.n_layer), rel=0.1)
    assert block.attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_forward_shapes_and_initial_loss() -> None:
    model = _tiny()
    idx = torch.randint(0, 256, (3, 40))
    targets = torch.randint(0, 256, (3, 40))
    logits = model(idx)
    assert logits.shape == (3, 40, 256)
    loss = model(idx, targets)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(math.log(256), abs=0.1)


def test_too_long_input_rejected() -> None:
    model = _tiny()
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_causal() -> None:
    model = _tiny().eval()
    idx = torch.randint(0, 256, (2, 32))
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :20], after[:, :20])
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_backward_reaches_every_parameter() -> None:
    model = _tiny()
    idx = torch.randint(0, 256, (2, 16))
    model(idx, idx).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_generate_length_and_context_crop() -> None:
    model = _tiny().eval()
    idx = torch.randint(0, 256, (2, 60))
    out = model.generate(idx, max_new_tokens=10, top_k=5)  # passes seq_len=64: crops context
    assert out.shape == (2, 70)
    assert out.dtype == torch.long
    assert torch.equal(out[:, :60], idx)
    greedy_a = model.generate(idx[:, :5], max_new_tokens=4, temperature=0.0)
    greedy_b = model.generate(idx[:, :5], max_new_tokens=4, temperature=0.0)
    assert torch.equal(greedy_a, greedy_b)
    gen = torch.Generator().manual_seed(1)
    sampled = model.generate(idx[:, :5], max_new_tokens=4, generator=gen)
    gen.manual_seed(1)
    assert torch.equal(sampled, model.generate(idx[:, :5], max_new_tokens=4, generator=gen))
    with pytest.raises(ValueError, match="temperature"):
        model.generate(idx, max_new_tokens=1, temperature=-1.0)
