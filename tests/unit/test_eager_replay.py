"""The eager order of a Hugging Face model's initialization, checked op by op against its eager
build on the meta device before anything real is drawn."""

from __future__ import annotations

import logging

import hf_models
import pytest
import torch
from torch import nn

import shardwise
from shardwise.engine import eager_replay, materialize

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


def test_gpt2_constructor_drawing_outside_reset_parameters_is_named(caplog):
    # GPT-2's Conv1D draws its weights in its constructor without reset_parameters: the replay
    # cannot repeat that, and says so instead of giving other values silently
    model = _meta(transformers.GPT2LMHeadModel, hf_models.tiny_gpt2().config)
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        assert eager_replay.verified_replay(model, materialize.scratch) is None
    assert "not equal to an eager build's" in caplog.text
    assert "transformer.h.0.attn.c_attn.weight" in caplog.text


class _ToyConfig(transformers.PretrainedConfig):
    model_type = "shardwise-toy"


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.proj = nn.Linear(4, 4)


class _Toy(transformers.PreTrainedModel):
    """Remote-code style: its own ``_init_weights``, a module with a parameter of its own."""

    config_class = _ToyConfig

    def __init__(self, config: _ToyConfig) -> None:
        super().__init__(config)
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Embedding(5, 4))
        self.scaled = _Scaled()
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


@pytest.mark.parametrize("build", ["toy", "llama_tied"])
def test_replayed_values_equal_the_eager_build_bitwise(build):
    config = _ToyConfig() if build == "toy" else hf_models.tiny_llama(tie=True).config

    def make():  # type: ignore[no-untyped-def]
        return _Toy(config) if build == "toy" else transformers.LlamaForCausalLM(config)

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


def test_init_writing_another_modules_weight_is_refused(caplog):
    with shardwise.deferred_init():
        model = _Toy(_ToyConfig(reach=True))
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        assert eager_replay.verified_replay(model, materialize.scratch) is None
    assert "'scaled.proj.weight (outside its step)'" in caplog.text
