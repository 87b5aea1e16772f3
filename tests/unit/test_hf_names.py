"""Stored names onto a model's own state_dict names, as from_pretrained maps them."""

from __future__ import annotations

import hf_models as hm
import pytest
import torch
from safetensors.torch import save_file

from shardwise.hf import WeightsError, map_names, model_spec, open_weights

pytest.importorskip("transformers")


def _hf_report(model_cls, config, path) -> tuple[set[str], set[str]]:
    """(missing, unexpected) as transformers' own from_pretrained reports them."""
    config.save_pretrained(path)
    _, info = model_cls.from_pretrained(path, output_loading_info=True)
    return set(info["missing_keys"]), set(info["unexpected_keys"])


def test_an_untied_llama_maps_onto_itself(tmp_path):
    model = hm.tiny_llama()
    hm.save(model, tmp_path, "20KB")
    with open_weights(tmp_path) as source:
        mapping = map_names(model_spec(model), source)
    assert mapping.complete and mapping.tied_from == {}
    assert mapping.source_of == {n: n for n in model.state_dict()}


def test_gpt2_ties_lm_head_to_the_stored_embedding(tmp_path):
    model = hm.tiny_gpt2()
    hm.save(model, tmp_path)
    with torch.device("meta"):
        meta = type(model)(model.config)
    spec = model_spec(meta)
    assert spec.tied == {"lm_head.weight": "transformer.wte.weight"}
    with open_weights(tmp_path) as source:
        assert "lm_head.weight" not in source
        mapping = map_names(spec, source, strict=True)
    assert mapping.complete
    assert mapping.source_of["lm_head.weight"] == "transformer.wte.weight"
    assert mapping.tied_from == {"lm_head.weight": "transformer.wte.weight"}
    assert list(mapping.source_of) == list(model.state_dict())


def test_base_model_weights_load_into_a_task_model_and_back(tmp_path):
    from transformers import GPT2LMHeadModel, GPT2Model, LlamaForCausalLM, LlamaModel

    gpt2 = hm.tiny_gpt2()
    gpt2.transformer.save_pretrained(tmp_path / "base")  # keys "h.0...", no prefix
    with open_weights(tmp_path / "base") as source:
        assert "wte.weight" in source
        mapping = map_names(model_spec(gpt2), source)
    assert mapping.source_of["transformer.wte.weight"] == "wte.weight"
    assert mapping.source_of["lm_head.weight"] == "wte.weight"
    assert _hf_report(GPT2LMHeadModel, gpt2.config, tmp_path / "base") == (set(), set())

    llama = hm.tiny_llama()
    hm.save(llama, tmp_path / "task")
    with open_weights(tmp_path / "task") as source:
        with pytest.raises(WeightsError) as exc:
            map_names(model_spec(llama.model), source, strict=True)
        assert "unexpected 1: lm_head.weight" in str(exc.value)
        assert "\n" not in str(exc.value)
        mapping = map_names(model_spec(llama.model), source, strict=False)
    assert mapping.source_of["layers.0.mlp.up_proj.weight"] == "model.layers.0.mlp.up_proj.weight"
    assert (set(mapping.missing), set(mapping.unexpected)) == _hf_report(
        LlamaModel, llama.config, tmp_path / "task"
    )
    assert _hf_report(GPT2Model, gpt2.config, tmp_path / "base") == (set(), set())
    assert LlamaForCausalLM  # the task model's own case is the first test


def test_a_peft_saved_full_model_drops_base_model_model(tmp_path):
    model = hm.tiny_llama()
    state = {f"base_model.model.{k}": v for k, v in model.state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    with open_weights(tmp_path) as source:
        mapping = map_names(model_spec(model), source)
    assert mapping.source_of == {n: f"base_model.model.{n}" for n in model.state_dict()}


def test_strict_names_every_problem_and_lenient_lists_them(tmp_path):
    from transformers import LlamaForCausalLM

    model = hm.tiny_llama()
    state = dict(model.state_dict())
    del state["model.norm.weight"]
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(65, 32)  # wrong shape
    state["model.layers.1.input_layernorm.weight"] = torch.zeros(32, dtype=torch.int32)  # kind
    state["model.extra.weight"] = torch.zeros(3)
    save_file(state, tmp_path / "model.safetensors")
    with open_weights(tmp_path) as source:
        with pytest.raises(WeightsError) as exc:
            map_names(model_spec(model), source, strict=True)
        msg = str(exc.value)
        assert "\n" not in msg and str(tmp_path / "model.safetensors") in msg
        for name in (
            "missing 1: model.norm.weight",
            "unexpected 1: model.extra.weight",
            "model.layers.0.mlp.up_proj.weight (stored as",
            "[65, 32] torch.float32, model has [64, 32] torch.float32",
            "model.layers.1.input_layernorm.weight",
        ):
            assert name in msg
        mapping = map_names(model_spec(model), source, strict=False)
    assert mapping.missing == ["model.norm.weight"]
    assert mapping.unexpected == ["model.extra.weight"]
    assert [m.name for m in mapping.mismatched] == [
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.input_layernorm.weight",
    ]
    assert "model.layers.0.mlp.up_proj.weight" not in mapping.source_of
    del state["model.layers.0.mlp.up_proj.weight"], state["model.layers.1.input_layernorm.weight"]
    save_file(state, tmp_path / "model.safetensors")
    missing, unexpected = _hf_report(LlamaForCausalLM, model.config, tmp_path)
    assert missing == {
        "model.norm.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.input_layernorm.weight",
    }
    assert unexpected == {"model.extra.weight"}


def test_stored_buffers_the_model_ignores_are_not_unexpected(tmp_path):
    model = hm.tiny_gpt2()
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state["transformer.h.0.attn.bias"] = torch.ones(1, 1, 4, 4)  # old GPT-2 files stored the mask
    save_file(state, tmp_path / "model.safetensors")
    with open_weights(tmp_path) as source:
        mapping = map_names(model_spec(model), source, strict=True)
    assert mapping.complete


def test_two_stored_names_for_one_model_name_are_refused(tmp_path):
    model = hm.tiny_llama()
    state = dict(model.state_dict())
    state["norm.weight"] = state["model.norm.weight"].clone()
    save_file(state, tmp_path / "model.safetensors")
    with open_weights(tmp_path) as source, pytest.raises(WeightsError) as exc:
        map_names(model_spec(model), source, strict=False)
    assert "'model.norm.weight'" in str(exc.value) and "'norm.weight'" in str(exc.value)


def test_a_mismatch_names_the_file_holding_the_tensor(tmp_path):
    model = hm.tiny_llama()
    hm.save(model, tmp_path, "20KB")  # shards: the index is not the file at fault
    with open_weights(tmp_path) as source:
        spec = model_spec(model)
        bad = spec.tensors["model.norm.weight"]._replace(shape=(31,))
        spec.tensors["model.norm.weight"] = bad
        holder = source.info("model.norm.weight").file.name
        with pytest.raises(WeightsError) as err:
            map_names(spec, source)
    assert f"model.norm.weight (stored as 'model.norm.weight' in {holder} [32]" in str(err.value)


def test_a_stage_maps_its_own_names_and_leaves_the_others(tmp_path):
    import dataclasses

    model = hm.tiny_llama()
    hm.save(model, tmp_path)
    full = model_spec(model)
    mine = {n: t for n, t in full.tensors.items() if n.startswith("model.layers.0.")}
    spec = dataclasses.replace(full, tensors=mine, elsewhere=frozenset(full.tensors) - set(mine))
    with open_weights(tmp_path) as source:
        mapping = map_names(spec, source, strict=True)  # the rest are another stage's
        assert mapping.complete and set(mapping.source_of) == set(mine)
        # a stored name no stage has is still unexpected
        narrow = dataclasses.replace(spec, elsewhere=spec.elsewhere - {"lm_head.weight"})
        with pytest.raises(WeightsError, match=r"unexpected 1: lm_head\.weight"):
            map_names(narrow, source, strict=True)
