"""Context parallelism in the cost model, ``estimate`` and the layout check: cp's bytes equal
the closed forms (ring: (cp - 1)/cp of K and V forward, K, V and their gradients backward;
all-to-all: four all-to-alls of 1/cp of the activations each way), activations and compute per
rank 1/cp, and the layout search choosing cp when the activations of the whole sequence do
not fit."""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.cli.main import main
from shardwise.comm.allreduce_rounds import LinkCost
from shardwise.costmodel import Plan, measured, predict
from shardwise.costmodel.context import cp_bytes_per_layer
from shardwise.costmodel.layout_search import AXES, search
from shardwise.costmodel.shapes import gpt_shape
from shardwise.estimate import estimate_activations, format_bytes
from shardwise.models.gpt import GPTConfig
from shardwise.parallel.layout import ESTIMATE_FLAGS, Layout, check_layout, gpt_dims

LINK = LinkCost(1e-4, 1e-9, duplex=False)
SMALL = GPTConfig.named("small")
SHAPE = gpt_shape("small", SMALL)


def _hw(memory: int = 1 << 34):
    return measured((LINK, LINK), 8, 1e10, memory, 5e9, overlap=False)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_cp_bytes_equal_the_closed_forms(cp, tp, recompute):
    b, s, h, e = 3, SHAPE.seq_len, SHAPE.hidden, 2  # bf16
    kv_full = 2 * b * s * h // tp * e  # K and V of the whole sequence, this rank's heads
    local = b * s // cp * h // tp * e  # this rank's [b, s/cp, h/tp] activation
    forwards = 1 if recompute == "none" else 2
    plan = Plan(cp=cp, tp=tp, micro_batch=b, recompute=recompute, precision="bf16")
    ring = (cp - 1) * kv_full // cp * (forwards + 2)  # forward(s), then K, V, dK, dV
    assert cp_bytes_per_layer(SHAPE, plan) == ring
    a2a = dataclasses.replace(plan, cp_method="all_to_all")
    assert cp_bytes_per_layer(SHAPE, a2a) == 4 * local * (forwards + 1)
    assert cp_bytes_per_layer(SHAPE, dataclasses.replace(plan, cp=1)) == 0


def test_cp_divides_activations_and_compute_and_prices_its_messages():
    hw = _hw()
    one = predict(SHAPE, Plan(micro_batches=2, micro_batch=4, precision="fp32"), hw)
    plan = Plan(cp=2, micro_batches=2, micro_batch=4, precision="fp32")
    two = predict(SHAPE, plan, hw)
    assert two.memory["activations"] == pytest.approx(one.memory["activations"] / 2, rel=1e-12)
    assert two.hardware_flops_per_step == pytest.approx(one.hardware_flops_per_step, rel=1e-12)
    assert two.breakdown["compute"] < one.breakdown["compute"]
    # ZeRO-0 holds everything; gradients now reduce over the two cp ranks
    assert two.memory["states"] == one.memory["states"] and two.breakdown["dp"] > 0
    kv_local = 2 * 4 * SHAPE.seq_len // 2 * SHAPE.hidden * 4
    per_layer = 3 * (LINK.alpha_s + kv_local * LINK.beta_s_per_byte)  # 3 ring steps of 1 block
    want = 2 * SHAPE.layers * per_layer
    assert two.breakdown["cp"] == pytest.approx(want, rel=1e-12) and one.breakdown["cp"] == 0


def test_search_chooses_cp_when_the_whole_sequence_does_not_fit():
    assert AXES == ("dp_replicate", "dp_shard", "cp", "tp", "pp")
    cfg = dataclasses.replace(GPTConfig.named("anchor"), seq_len=1024)
    shape = gpt_shape("anchor", cfg)
    roomy = search(shape, 4, _hw(), 4)
    assert {(r.layout.plan.cp, r.layout.plan.cp_method) for r in roomy.ranked} >= {
        (1, "ring"),
        (2, "ring"),
        (2, "all_to_all"),
        (4, "ring"),
    }
    tight = search(shape, 4, _hw(1 << 28), 4)
    assert tight.ranked and tight.ranked[0].layout.plan.cp > 1
    assert all(r.prediction.memory["total"] <= 1 << 28 for r in tight.ranked)


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        (Layout(world_size=6, cp=4), "--cp 4 does not divide --world-size 6: use --world-size "
         "4 or 8"),
        (Layout(world_size=6, cp=4, tp=2), "--tp 2 x --cp 4 does not divide --world-size 6"),
        (Layout(world_size=3, cp=3), "--cp 3 splits each sequence into 2 x cp = 6 equal chunks: "
         "the sequence length 64 must divide by 6: change --seq-len (e.g. 60 or 66) or --cp"),
        (Layout(world_size=4, cp=4, cp_method="all_to_all"), "all_to_all splits the 2 heads per "
         "tp rank of the tiny model over --cp 4: use --cp 2 or --cp-method ring"),
        (Layout(world_size=4, cp=2, tp=2, cp_method="all_to_all"), "all_to_all splits the 1 "
         "heads per tp rank of the tiny model over --cp 2: use --cp 1 or --cp-method ring"),
        (Layout(world_size=2, cp=2, cp_method="ulysses"), "--cp-method must be one of ring, "
         "all_to_all"),
    ],
)  # fmt: skip
def test_the_layout_check_refuses_what_cp_cannot_split(layout, expected):
    tiny = gpt_dims("tiny", GPTConfig.named("tiny"))  # 2 heads, seq_len 64
    with pytest.raises(ValueError) as err:
        check_layout(layout, model=tiny, flags=ESTIMATE_FLAGS)
    assert expected in str(err.value) and "\n" not in str(err.value)
    check_layout(Layout(world_size=8, cp=4, tp=2), model=tiny, flags=ESTIMATE_FLAGS)


def test_estimate_cp_prints_activations_and_bytes_per_rank(capsys):
    argv = ["estimate", "--model", "small", "--world-size", "8", "--micro-batch", "4"]
    assert main([*argv, "--cp", "2"]) == 0
    out = capsys.readouterr().out
    half = SMALL.seq_len // 2
    act = estimate_activations(SMALL, 4, half, "fp32")
    assert act * 2 == estimate_activations(SMALL, 4, SMALL.seq_len, "fp32")
    assert f"activations per rank (micro-batch 4 x {half} tokens): {format_bytes(act)}" in out
    ring = 3 * 2 * 4 * half * SMALL.d_model * 4  # (cp - 1) x 3 x K and V of this rank
    assert f"sends {format_bytes(ring)} per layer and micro-batch of 4 over cp" in out
    assert main([*argv, "--cp", "2", "--cp-method", "all_to_all"]) == 0
    a2a = 8 * 4 * half * SMALL.d_model * 4
    assert f"sends {format_bytes(a2a)} per layer" in capsys.readouterr().out
    assert main(["estimate", "--params", "1e6", "--cp", "2"]) == 2
    assert "--cp splits a model's layers: give --model" in capsys.readouterr().err
