"""Writing Hugging Face model directories tensor by tensor that from_pretrained loads."""

from __future__ import annotations

import json

import hf_models as hm
import pytest
import torch
from safetensors import safe_open

from shardwise.bytesize import parse_bytes
from shardwise.hf import (
    TensorSpec,
    WeightsError,
    model_spec,
    open_weights,
    plan_shards,
    write_model_dir,
)
from shardwise.hf.model_dir import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

pytest.importorskip("transformers")


def _to_save(model) -> list[TensorSpec]:
    """The model's tensors without tied duplicates (the first name of a tie is kept)."""
    spec = model_spec(model)
    return [t for n, t in spec.tensors.items() if n not in spec.tied]


def _export(model, out, max_shard_size="20KB", dtype=None, **kw):
    state = model.state_dict()
    tensors = _to_save(model)
    if dtype is not None:
        tensors = [t._replace(dtype=dtype) for t in tensors]
    calls: list[str] = []

    def produce(name: str) -> torch.Tensor:
        calls.append(name)
        return state[name] if dtype is None else state[name].to(dtype)

    plan = write_model_dir(
        out,
        tensors,
        produce,
        max_shard_size,
        config=model.config,
        generation_config=model.generation_config,
        **kw,
    )
    assert calls == list(plan.weight_map)  # once each, file by file, in plan order
    return plan


def _weight_files(path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if "safetensors" in p.name)


@pytest.mark.parametrize("limit", ["20KB", "9000", 4096, "7KiB", "50GB"])
def test_the_split_is_save_pretrained_s(limit):
    from huggingface_hub import split_torch_state_dict_into_shards

    model = hm.tiny_llama(tie=True)
    state = {t.name: model.state_dict()[t.name] for t in _to_save(model)}
    theirs = split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=parse_bytes(limit)
    )
    plan = plan_shards(_to_save(model), limit)
    ours = {file: [t.name for t in specs] for file, specs in plan.files}
    assert ours == theirs.filename_to_tensors
    assert list(ours) == list(theirs.filename_to_tensors)  # the same file order
    assert plan.total_size == theirs.metadata["total_size"]


@pytest.mark.parametrize("kind,limit", [("llama", "20KB"), ("llama", "50GB"), ("gpt2", "20KB")])
def test_from_pretrained_loads_the_export_with_identical_logits(tmp_path, kind, limit):
    from transformers import AutoModelForCausalLM

    model = hm.tiny_llama(tie=True) if kind == "llama" else hm.tiny_gpt2()
    plan = _export(model, tmp_path, limit)
    files = _weight_files(tmp_path)
    if plan.sharded:
        assert files == sorted([*(f for f, _ in plan.files), SAFE_WEIGHTS_INDEX_NAME])
        index = json.loads((tmp_path / SAFE_WEIGHTS_INDEX_NAME).read_text())
        assert index["metadata"]["total_size"] == plan.total_size
        assert index["weight_map"] == plan.weight_map
        for file, specs in plan.files:
            with safe_open(str(tmp_path / file), "pt") as f:
                assert list(f.keys()) == sorted(t.name for t in specs)
                assert f.metadata() == {"format": "pt"}
    else:
        assert files == [SAFE_WEIGHTS_NAME]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    x = hm.tokens()
    assert torch.equal(hm.logits(loaded, x), hm.logits(model, x))
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name


def test_a_bf16_export_of_fp32_weights_loads_as_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    model = hm.tiny_llama()
    _export(model, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t.to(torch.bfloat16)), name


def test_configs_and_tokenizer_files_travel_with_the_weights(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>")
    tok.save_pretrained(tmp_path / "tok")
    model = hm.tiny_llama()
    model.generation_config.max_new_tokens = 7
    _export(model, tmp_path / "out", "50GB", tokenizer_dir=tmp_path / "tok")
    out = tmp_path / "out"
    assert GenerationConfig.from_pretrained(out).max_new_tokens == 7
    copied = sorted(p.name for p in (tmp_path / "tok").iterdir())
    for name in copied:
        assert (out / name).read_bytes() == (tmp_path / "tok" / name).read_bytes()
    again = AutoTokenizer.from_pretrained(out)
    assert again("hello world")["input_ids"] == tok("hello world")["input_ids"]
    assert not list(out.glob("*.tmp"))


@pytest.mark.parametrize("bad", ["shape", "dtype", "meta", "not a tensor"])
def test_a_bad_tensor_writes_nothing_final_and_keeps_the_last_export(tmp_path, bad):
    from transformers import AutoModelForCausalLM

    model = hm.tiny_llama()
    _export(model, tmp_path, "50GB")  # a good export already there
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    state = model.state_dict()
    plan = plan_shards(_to_save(model), "20KB")
    victim_file, victim_specs = plan.files[2]
    victim = victim_specs[0].name

    def produce(name: str):
        if name != victim:
            return state[name]
        return {
            "shape": lambda: state[name][:-1],
            "dtype": lambda: state[name].double(),
            "meta": lambda: torch.empty_like(state[name], device="meta"),
            "not a tensor": lambda: state[name].tolist(),
        }[bad]()

    with pytest.raises(WeightsError) as exc:
        write_model_dir(tmp_path, _to_save(model), produce, "20KB", config=model.config)
    msg = str(exc.value)
    assert "\n" not in msg and victim_file in msg and repr(victim) in msg
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(hm.logits(loaded, hm.tokens()), hm.logits(model, hm.tokens()))


def test_a_new_export_replaces_every_file_of_the_old_one(tmp_path):
    from transformers import AutoModelForCausalLM

    old, new = hm.tiny_llama(seed=1), hm.tiny_llama(seed=2)
    _export(old, tmp_path, "20KB")
    assert len(_weight_files(tmp_path)) == 8
    _export(new, tmp_path, "50GB")
    assert _weight_files(tmp_path) == [SAFE_WEIGHTS_NAME]
    _export(old, tmp_path, "30KB")
    with open_weights(tmp_path) as source:
        assert source.files.index is not None
        assert len(source.files.files) == len(_weight_files(tmp_path)) - 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(hm.logits(loaded, hm.tokens()), hm.logits(old, hm.tokens()))


def test_bad_plans_are_refused():
    t = TensorSpec("a", (2, 2), torch.float32)
    with pytest.raises(ValueError, match="no tensors"):
        plan_shards([], "5GB")
    with pytest.raises(ValueError, match="listed twice"):
        plan_shards([t, t], "5GB")
    with pytest.raises(ValueError, match="cannot parse byte size"):
        plan_shards([t], "5 gigs")
    with pytest.raises(ValueError, match="> 0"):
        plan_shards([t], 0)
    assert plan_shards([t], "500MB").files == (("model.safetensors", (t,)),)
