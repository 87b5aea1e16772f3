"""The eager order of a Hugging Face model's initialization, checked op by op against its eager
build on the meta device before anything real is drawn."""

from __future__ import annotations

import logging

import hf_models
import pytest
import torch
from torch import nn

import shardwise
from shardwise.deferred import eager_replay
from shardwise.deferred import init as materialize

transformers = pytest.importorskip("transformers")


def _meta(cls, config):  # type: ignore[no-untyped-def]
    with shardwise.deferred_init():
        return cls(config)


@pytest.mark.parametrize("tie", [False, True])
def test_llama_replay_checks_against_its_eager_build(tie):
    model = _meta(transformers.LlamaForCausalLM, hf_models.tiny_llama(tie=tie).config)
    replay = eager_replay.verified_replay(model, materialize.scratch)
    assert replay is not None
    kinds = [(s.kind, s.name) for s in replay.steps]
    # the base model's constructors and post_init come before the head's constructor
    assert kinds.index(("init", "model")) < kinds.index(("reset", "lm_head"))
    assert kinds[-2:] == [("init", "lm_head"), ("init", "")]
    written = {name for _, name in replay.touches}
    assert written == {n for n, _ in model.named_parameters()}


def test_gpt2_constructor_draws_and_parent_writes_are_replayed():
    # GPT-2's Conv1D draws in its constructor without reset_parameters (its recorded ops are
    # replayed), and its attention's _init_weights rescales its child c_proj (that step holds
    # c_proj's parameters too)
    model = _meta(transformers.GPT2LMHeadModel, hf_models.tiny_gpt2().config)
    replay = eager_replay.verified_replay(model, materialize.scratch)
    assert replay is not None
    kinds = {(s.kind, s.name) for s in replay.steps}
    assert ("record", "transformer.h.0.attn.c_attn") in kinds
    step = next(s for s in replay.steps if (s.kind, s.name) == ("init", "transformer.h.0.attn"))
    assert step.extra == (model.transformer.h[0].attn.c_proj,)


class _ToyConfig(transformers.PretrainedConfig):
    model_type = "shardwise-toy"


class _Scaled(nn.Module):
    def __init__(self, noise: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.proj = nn.Linear(4, 4)
        if noise:  # drawn out of place, then made a parameter: nothing to replay it by
            self.noise = nn.Parameter(torch.randn(4))


class _Toy(transformers.PreTrainedModel):
    """Remote-code style: its own ``_init_weights``, a module with a parameter of its own."""

    config_class = _ToyConfig

    def __init__(self, config: _ToyConfig) -> None:
        super().__init__(config)
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Embedding(5, 4))
        self.scaled = _Scaled(getattr(config, "noise", False))
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, _Scaled):
            module.scale.fill_(0.5)
            if getattr(self.config, "reach", False):
                module.proj.weight.normal_()  # a parent writing its child's weight
        elif isinstance(module, nn.Linear):
            module.weight.normal_(std=0.1)


def _whole_init(model):  # type: ignore[no-untyped-def]
    """Every parameter of a meta-built ``model`` made real by the unit-by-unit replay."""
    materialize.materialize_kept(model, model, torch.device("cpu"))
    return model.state_dict()


BUILDS = {
    "toy": (_Toy, lambda: _ToyConfig()),
    "toy_reaching_into_a_child": (_Toy, lambda: _ToyConfig(reach=True)),
    "llama_tied": (transformers.LlamaForCausalLM, lambda: hf_models.tiny_llama(tie=True).config),
    "gpt2": (transformers.GPT2LMHeadModel, lambda: hf_models.tiny_gpt2().config),
}


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_replayed_values_equal_the_eager_build_bitwise(build):
    cls, config_of = BUILDS[build]
    config = config_of()

    def make():  # type: ignore[no-untyped-def]
        return cls(config)

    torch.manual_seed(3)
    eager = make().state_dict()
    torch.manual_seed(3)
    with shardwise.deferred_init():
        meta = make()
    got = _whole_init(meta)
    assert set(got) == set(eager)
    for name, value in eager.items():
        assert torch.equal(got[name], value), name
    # the random state after the replay is the eager build's: later draws agree too
    torch.manual_seed(3)
    make()
    want = torch.rand(3)
    assert torch.equal(_rand_after_replay(make), want)


def _rand_after_replay(make):  # type: ignore[no-untyped-def]
    torch.manual_seed(3)
    with shardwise.deferred_init():
        meta = make()
    _whole_init(meta)
    return torch.rand(3)


def test_a_draw_the_replay_cannot_repeat_is_named_and_refused(caplog):
    with shardwise.deferred_init():
        model = _Toy(_ToyConfig(noise=True))
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        assert eager_replay.verified_replay(model, materialize.scratch) is None
    assert "not equal to an eager build's" in caplog.text
    assert "'randn'" in caplog.text  # the eager build's draw the replay lacks
