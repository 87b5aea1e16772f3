"""What ``shardwise finetune --auto`` searches: a Hugging Face model's shape for the cost model
(read from the model built on the meta device), frozen parameters priced as weights only, and
the axes and tp degrees the fine-tuning run can use."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from shardwise.comm.allreduce_rounds import LinkCost
from shardwise.config import Config
from shardwise.costmodel import Plan, measured, predict
from shardwise.costmodel.layout_search import Layout, SearchSpace, search
from shardwise.costmodel.memory import model_states
from shardwise.costmodel.predict import GRAD_BYTES, ring_seconds
from shardwise.costmodel.shapes import ModelShape
from shardwise.train import layout_choice
from shardwise.train.options import RunConfig, TrainOptions

pytest.importorskip("peft")
LINK = LinkCost(1e-4, 1e-9, duplex=False)
SHAPE = ModelShape("m", 4, 256, 8, 1000, 128, ffn_hidden=512, kv_heads=4, mlp_matrices=3)


def _hw():
    return measured((LINK, LINK), 8, 1e10, 1 << 34, 5e9, overlap=False)


def _params(shape: ModelShape) -> int:
    return shape.layers * shape.layer_params() + shape.embedding_params()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_parameters_hold_weights_only(stage):
    lora = dataclasses.replace(SHAPE, trainable=0.25)
    plan = Plan(dp=4, zero_stage=stage, precision="bf16", micro_batch=1)
    full, part = predict(SHAPE, plan, _hw()), predict(lora, plan, _hw())
    n = _params(SHAPE)
    trained = model_states(math.ceil(n * 0.25), 4, stage, "bf16", grad_dtype="fp32").total_bytes
    frozen = math.ceil(n * 0.75)
    frozen = math.ceil(frozen / 4) * 2 if stage == 3 else frozen * 2  # bf16 weights
    assert part.memory["states"] == trained + frozen
    assert full.memory["states"] == model_states(n, 4, stage, "bf16", grad_dtype="fp32").total_bytes
    assert part.breakdown["optimizer"] == pytest.approx(full.breakdown["optimizer"] * 0.25)


def test_frozen_parameters_send_no_gradients_but_zero3_gathers_them():
    lora = dataclasses.replace(SHAPE, trainable=0.25)
    n, hw = _params(SHAPE), _hw()
    link = hw.collective_link("all_reduce", 1, 4)
    plan = Plan(dp=4, zero_stage=0, micro_batch=1)
    assert predict(lora, plan, hw).breakdown["dp"] == pytest.approx(
        ring_seconds(link, n * 0.25 * GRAD_BYTES, 4)
    )
    z3 = Plan(dp=4, zero_stage=3, micro_batch=1, micro_batches=2, precision="bf16")
    rs = ring_seconds(hw.collective_link("reduce_scatter", 1, 4), n * 0.25 * GRAD_BYTES, 4,
                      "reduce_scatter")  # fmt: skip
    ag = ring_seconds(hw.collective_link("all_gather", 1, 4), n * 2, 4, "all_gather")
    assert predict(lora, z3, hw).breakdown["dp"] == pytest.approx(rs + 4 * ag)


def test_trainable_must_be_a_share():
    with pytest.raises(ValueError, match="trainable must be in"):
        dataclasses.replace(SHAPE, trainable=0.0)


def test_fixed_axes_keep_a_dimension_at_one():
    space = SearchSpace(fixed_axes=("cp", "pp"), precision="fp32")
    result = search(SHAPE, 4, _hw(), 8, space)
    assert result.ranked and all(
        r.layout.plan.pp == 1 and r.layout.plan.cp == 1 for r in result.ranked
    )
    assert {r.layout.plan.tp for r in result.ranked} == {1, 2, 4}  # 4 kv heads split by 4
    with pytest.raises(ValueError, match="not mesh axes"):
        SearchSpace(fixed_axes=("ep",))


def test_tp_needs_the_key_value_heads_to_divide():
    gqa = dataclasses.replace(SHAPE, kv_heads=2)
    result = search(gqa, 4, _hw(), 8, SearchSpace(fixed_axes=("cp", "pp"), precision="fp32"))
    assert {r.layout.plan.tp for r in result.ranked} == {1, 2}


# ---- the Hugging Face side: a model directory's shape and search ------------------------------


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from shardwise.sft import demo

    root = tmp_path_factory.mktemp("ftauto")
    return {kind: demo.model_dir(root / kind, kind) for kind in ("llama", "gpt2")}


def _model(path: Path, lora: str | None):
    from shardwise.deferred import deferred_init
    from shardwise.sft.lora import LoraSpec, apply_lora
    from shardwise.sft.model import build_model, check_model_dir

    config = check_model_dir(path)
    with deferred_init():
        model = build_model(config)
    return config, (model if lora is None else apply_lora(model, LoraSpec.parse(lora)))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_model_shape_matches_the_model(dirs, kind):
    from shardwise.train.finetune_auto import model_shape

    config, model = _model(dirs[kind], None)
    shape = model_shape(model, config, 48, kind)
    assert shape.params() == sum(p.numel() for p in model.parameters())
    assert (shape.layers, shape.hidden, shape.heads, shape.seq_len, shape.trainable) == (
        config.num_hidden_layers, config.hidden_size, config.num_attention_heads, 48, 1.0
    )  # fmt: skip
    assert shape.mlp_matrices == (3 if kind == "llama" else 2)  # gated (SwiGLU) or not
    assert shape.kv_heads == getattr(config, "num_key_value_heads", config.num_attention_heads)
    assert shape.tied_embeddings == (kind == "gpt2")


def test_lora_shape_trains_the_adapters_share(dirs):
    from shardwise.train.finetune_auto import model_shape

    config, model = _model(dirs["llama"], "r=4,alpha=8,targets=q_proj,v_proj")
    params = list(model.parameters())
    adapters = sum(p.numel() for p in params if p.requires_grad)
    assert 0 < adapters < sum(p.numel() for p in params)
    shape = model_shape(model, config, 48, "llama")
    assert shape.trainable == adapters / sum(p.numel() for p in params)
    assert shape.params() == sum(p.numel() for p in params)


def _run(world: int = 4) -> RunConfig:
    return RunConfig(train=TrainOptions(seq_len=48), engine=Config(micro_batch_size=2),
                     world_size=world, launch={"nproc_per_node": world},
                     finetune={"model_dir": "unused"})  # fmt: skip


def test_finetune_search_covers_dp_zero_tp_only_and_keeps_the_run_a_finetune(dirs):
    from shardwise.sft.lora import LoraSpec
    from shardwise.train.finetune_auto import finetune_target

    target, checks = finetune_target(dirs["llama"], LoraSpec.parse("r=4,targets=q_proj"), 48)
    assert target.fixed_axes == ("cp", "pp") and not target.sequence_parallel
    assert target.blocks == ("LlamaDecoderLayer",)
    choice = layout_choice.choose(_run(), _hw(), 8, {}, checks, 0.0, target)
    plans = [r.layout.plan for r in choice.result.ranked]
    assert plans and {p.pp for p in plans} == {1} and {p.cp for p in plans} == {1}
    assert not any(p.sequence_parallel for p in plans)
    # 4 heads, 2 key/value heads: tp 4 does not split the model, tp 2 does
    assert {p.tp for p in plans} == {1, 2}
    assert {p.zero_stage for p in plans} == {0, 1, 2, 3}
    full = next(r for r in choice.result.ranked if r.layout.plan.recompute == "full")
    run = layout_choice.run_config(_run(), full.layout, target.blocks)
    assert run.finetune == {"model_dir": "unused"}
    assert run.engine.activation_checkpointing == ["LlamaDecoderLayer"]


def test_a_tp_degree_the_plan_cannot_split_is_refused_by_the_check(dirs):
    from shardwise.sft.lora import LoraSpec
    from shardwise.train.finetune_auto import finetune_target

    _, checks = finetune_target(dirs["llama"], LoraSpec.parse("r=4,targets=embed_tokens"), 48)
    run = _run()
    run.train = dataclasses.replace(run.train, tp=2)
    with pytest.raises(ValueError, match="--tp 2"):
        checks[0](run)
    layout = Layout(Plan(dp=2, tp=2, micro_batch=2))
    assert not layout_choice.keeper(_run(), {}, checks)(layout)
