"""The eager order of a Hugging Face model's initialization, checked op by op against its eager
build on the meta device before anything real is drawn."""

from __future__ import annotations

import logging

import hf_models
import pytest

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
