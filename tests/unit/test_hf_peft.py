"""LoRA adapters written for peft, and LoRA merged into an exported full model."""

from __future__ import annotations

import hf_models as hm
import pytest
import torch
from safetensors import safe_open

from shardwise.hf import (
    TensorSpec,
    adapter_key,
    lora_merge_plan,
    merge_lora,
    model_spec,
    write_adapter_dir,
    write_model_dir,
)

pytest.importorskip("peft")


def _lora(kind: str, **extra):
    from peft import LoraConfig, get_peft_model

    if kind == "llama":
        base = hm.tiny_llama()
        targets = ["q_proj", "v_proj", "down_proj", "embed_tokens"]
    else:
        base = hm.tiny_gpt2()
        targets = ["c_attn", "c_proj"]  # Conv1D: weights stored [in, out]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **extra)
    torch.manual_seed(5)  # init_lora_weights=False: B is random too, so the adapter matters
    return get_peft_model(base, config).eval()


def _fresh_base(kind: str):
    return hm.tiny_llama() if kind == "llama" else hm.tiny_gpt2()


def _write_adapter(peft_model, out):
    state = peft_model.state_dict()
    saved = {adapter_key(n): n for n in state if adapter_key(n) is not None}
    tensors = [TensorSpec(k, tuple(state[n].shape), state[n].dtype) for k, n in saved.items()]
    config = peft_model.peft_config["default"]
    return write_adapter_dir(out, tensors, lambda k: state[saved[k]], config)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_peft_loads_the_adapter_with_identical_logits(tmp_path, kind):
    from peft import PeftModel

    peft_model = _lora(kind)
    path = _write_adapter(peft_model, tmp_path / "ours")
    peft_model.save_pretrained(tmp_path / "theirs", save_embedding_layers=False)
    with (
        safe_open(str(path), "pt") as ours,
        safe_open(str(tmp_path / "theirs" / path.name), "pt") as theirs,
    ):
        assert sorted(ours.keys()) == sorted(theirs.keys())
        for key in ours.keys():
            assert torch.equal(ours.get_tensor(key), theirs.get_tensor(key)), key
    loaded = PeftModel.from_pretrained(_fresh_base(kind), tmp_path / "ours").eval()
    x = hm.tokens()
    assert torch.equal(hm.logits(loaded, x), hm.logits(peft_model, x))


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("llama", {}),
        ("gpt2", {}),
        (
            "llama",
            {"use_rslora": True, "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"q_proj": 3}},
        ),
    ],
)
def test_the_merged_export_equals_merge_and_unload(tmp_path, kind, extra):
    from transformers import AutoModelForCausalLM

    peft_model = _lora(kind, **extra)
    state = {k: v.clone() for k, v in peft_model.state_dict().items()}  # merging is in place
    plan = lora_merge_plan(state, peft_model.peft_config["default"])
    assert sum(d is not None for _, d in plan.values()) > 0

    def produce(name: str) -> torch.Tensor:
        source, delta = plan[name]
        if delta is None:
            return state[source]
        return merge_lora(name, state[source], state[delta.lora_a], state[delta.lora_b], delta)

    x = hm.tokens()
    peft_logits = hm.logits(peft_model, x)
    merged = peft_model.merge_and_unload()
    spec = model_spec(merged)
    assert sorted(plan) == sorted(spec.tensors)
    tensors = [t for n, t in spec.tensors.items() if n not in spec.tied]
    write_model_dir(tmp_path, tensors, produce, "20KB", config=merged.config)
    for name, t in merged.state_dict().items():
        torch.testing.assert_close(produce(name), t, rtol=0, atol=1e-6)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(hm.logits(loaded, x), hm.logits(merged, x), rtol=0, atol=1e-5)
    torch.testing.assert_close(hm.logits(loaded, x), peft_logits, rtol=0, atol=1e-5)


def test_unsupported_adapters_and_misfit_updates_are_refused(tmp_path):
    from peft import LoraConfig

    with pytest.raises(ValueError, match="use_dora"):
        write_adapter_dir(tmp_path, [], lambda k: torch.zeros(1), LoraConfig(use_dora=True))
    with pytest.raises(ValueError, match="modules_to_save"):
        lora_merge_plan([], LoraConfig(modules_to_save=["lm_head"]))
    assert not list(tmp_path.iterdir())
    peft_model = _lora("gpt2")
    state = peft_model.state_dict()
    plan = lora_merge_plan(state, peft_model.peft_config["default"])
    name = "transformer.h.0.attn.c_attn.weight"  # [32, 96]: the wrong transpose cannot fit
    source, delta = plan[name]
    assert delta is not None and delta.transpose
    wrong = delta.__class__(delta.lora_a, delta.lora_b, delta.rank, delta.scaling, False)
    with pytest.raises(ValueError, match="fan_in_fan_out") as exc:
        merge_lora(name, state[source], state[delta.lora_a], state[delta.lora_b], wrong)
    assert repr(name) in str(exc.value)
