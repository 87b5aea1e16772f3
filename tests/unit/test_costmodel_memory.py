"""The one memory model (``shardwise.costmodel.memory`` and ``.activations``): HSDP shard groups,
gradient dtypes, activation element sizes, and its callers agreeing with it."""

from __future__ import annotations

import math

import pytest

from shardwise.config import Config
from shardwise.costmodel import hardware, predict, shape
from shardwise.costmodel.activations import (
    in_flight_activation_bytes,
    layer_activation_bytes,
)
from shardwise.costmodel.memory import model_states, model_states_by_stage, zero_shard_size
from shardwise.costmodel.plan import Plan
from shardwise.train.options import RunConfig, TrainOptions
from shardwise.train.summary import memory_estimate


def test_hsdp_shards_over_one_replica() -> None:
    assert zero_shard_size(8) == 8
    assert zero_shard_size(8, 2) == 4
    with pytest.raises(ValueError, match="dp_replicate=3"):
        zero_shard_size(8, 3)
    # 1001 parameters over a shard group of 4 pad to 1004: 251 per rank
    est = model_states(1001, zero_shard_size(8, 2), 3, "fp32")
    assert (est.params_bytes, est.grads_bytes, est.optimizer_bytes) == (4 * 251, 4 * 251, 8 * 251)


def test_a_run_under_hsdp_is_estimated_over_its_shard_group() -> None:
    """4 dp ranks as 2 replicas of 2: ZeRO-3 holds half the model per rank, not a quarter."""
    engine = Config(zero_stage=3, micro_batch_size=2)
    run = RunConfig(train=TrainOptions(model="tiny", dp_replicate=2), engine=engine, world_size=4)
    psi = run.model.param_count()
    assert memory_estimate(run)["params"] == 4 * math.ceil(psi / 2)
    flat = RunConfig(train=TrainOptions(model="tiny"), engine=engine, world_size=4)
    assert memory_estimate(flat)["params"] == 4 * math.ceil(psi / 4)


def test_gradient_dtypes() -> None:
    """Full gradients in the compute dtype by default, fp32 when accumulated so; a shard in
    the reduce dtype (fp32 by default)."""
    by_stage = model_states_by_stage(1200, 4, "bf16")
    fp32_grads = model_states_by_stage(1200, 4, "bf16", grad_dtype="fp32")
    assert [by_stage[s].grads_bytes for s in range(4)] == [2400, 2400, 1200, 1200]
    assert [fp32_grads[s].grads_bytes for s in range(4)] == [4800, 4800, 1200, 1200]
    assert model_states(1200, 4, 2, "bf16", reduce_dtype="bf16").grads_bytes == 600
    with pytest.raises(ValueError, match="grad_dtype"):
        model_states(1200, 4, 0, "bf16", grad_dtype="fp8")


def test_activation_element_size_scales_the_16_bit_formulas() -> None:
    s, b, h, a = 64, 2, 32, 4
    half = layer_activation_bytes(s, b, h, a, 2, True)
    assert half == s * b * h * (34 + 5 * a * s // h) // 2
    assert layer_activation_bytes(s, b, h, a, 2, True, element_bytes=4) == 2 * half
    assert in_flight_activation_bytes(half, 3, 2) == 6 * half


def test_the_cost_model_prices_memory_by_the_stage_table() -> None:
    """``predict``'s model states for the heaviest stage (half the layers and the embedding,
    then half of that per tp rank), padded shards, fp32 gradients."""
    m, hw = shape("gpt-1.7b"), hardware("a100x8-ib")
    held = math.ceil((m.layers / 2 * m.layer_params() + m.vocab * m.hidden) / 2)
    shard = math.ceil(held / 4)
    want = {
        "bf16": [18 * held, 6 * held + 12 * shard, 2 * held + 16 * shard, 18 * shard],
        "fp32": [16 * held, 8 * held + 8 * shard, 4 * held + 12 * shard, 16 * shard],
    }
    for precision, per_stage in want.items():
        for stage in range(4):
            plan = Plan(dp=4, tp=2, pp=2, zero_stage=stage, precision=precision)
            assert predict(m, plan, hw).memory["states"] == per_stage[stage], (precision, stage)
