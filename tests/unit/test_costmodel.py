"""The cost model: published throughputs reproduced within 15%, its formulas against the papers'
closed forms, memory by ZeRO stage, plan ranking and the command."""

from __future__ import annotations

import pytest

from shardwise.cli.main import main
from shardwise.comm.allreduce_rounds import GroupLinks, LinkCost, predict_seconds
from shardwise.costmodel import Plan, hardware, predict, ring_seconds, shape
from shardwise.costmodel.published import FIGURES, comparison_table
from shardwise.costmodel.search import rank_plans, scaling


@pytest.mark.parametrize("fig", FIGURES, ids=lambda f: f.label)
def test_published_figures_within_15_percent(fig):
    assert abs(fig.error()) <= 0.15, comparison_table()


def test_predictions_outnumber_calibrations():
    assert sum(not f.calibration for f in FIGURES) >= 3


def test_flops_match_megatrons_formula():
    # Narayanan et al. 2021 eq. (3): 96 B s l h^2 (1 + s/6h + V/16lh) with recomputation
    m = shape("gpt-1t")
    plan = Plan(dp=6, tp=8, pp=64, micro_batches=512, recompute="full")
    pred = predict(m, plan, hardware("a100x8-ib"))
    b, s, n, h, v = 3072, m.seq_len, m.layers, m.hidden, m.vocab
    megatron = 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    assert pred.hardware_flops_per_step == pytest.approx(megatron, rel=1e-9)
    assert pred.model_flops_per_step == pytest.approx(megatron * 3 / 4, rel=2e-3)


@pytest.mark.parametrize(
    "kw,bubble",
    [
        ({"pp": 4, "micro_batches": 8}, 3 / 8),
        ({"pp": 4, "micro_batches": 8, "schedule": "interleaved", "virtual_stages": 2}, 3 / 16),
        ({"pp": 4, "micro_batches": 8, "schedule": "zb-h1"}, 3 / 24),
        ({"pp": 1, "micro_batches": 8}, 0.0),
    ],
)
def test_bubble_fractions(kw, bubble):
    assert Plan(**kw).bubble_fraction() == pytest.approx(bubble)


def test_ring_matches_the_comm_schedule_prediction():
    link = LinkCost(2e-5, 1e-10)
    nbytes = 4 * 8 * 1000
    links = GroupLinks((0,) * 8, link, link)
    assert ring_seconds(link, nbytes, 8) == pytest.approx(predict_seconds("ring", nbytes, 4, links))


def test_memory_by_zero_stage():
    m = shape("7b")
    hw = hardware("h100x8-ib")
    psi = m.params()
    states = [predict(m, Plan(dp=8, zero_stage=z), hw).memory["states"] for z in range(4)]
    # bf16 weights, fp32 gradients, fp32 master + two Adam moments (18 bytes per parameter)
    assert states[0] == pytest.approx(18 * psi)
    assert states[1] == pytest.approx((2 + 4 + 12 / 8) * psi)
    assert states[2] == pytest.approx((2 + 16 / 8) * psi)
    assert states[3] == pytest.approx(18 / 8 * psi)


def test_activations_follow_korthikanti():
    m = shape("gpt-18b")
    s, b, h, a = m.seq_len, 1, m.hidden, m.heads
    hw = hardware("a100x8-ib")
    logits = s * b * m.vocab * 4
    none = predict(m, Plan(), hw).memory["activations"] - logits
    assert none == pytest.approx(m.layers * s * b * h * (34 + 5 * a * s / h))
    sp = predict(m, Plan(tp=8, sequence_parallel=True, recompute="selective"), hw)
    assert sp.memory["activations"] - logits / 8 == pytest.approx(m.layers * 34 * s * b * h / 8)


def test_rank_plans_fit_and_are_sorted():
    m, hw = shape("7b"), hardware("h100x8-ib")
    assert rank_plans(m, 1, hw, 8) == []  # 7B with AdamW does not fit one 80 GB device
    ranked = rank_plans(m, 16, hw, 256, top=20)
    assert ranked and all(p.fits for p in ranked)
    speeds = [p.tokens_per_s_per_device for p in ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert all(p.plan.tp <= hw.devices_per_node and p.plan.devices == 16 for p in ranked)


def test_weak_scaling_of_7b_on_h100():
    points = scaling(shape("7b"), hardware("h100x8-ib"), [2, 8, 16, 64], 4)
    assert [p.devices for p in points] == [2, 8, 16, 64]
    assert points[1].efficiency >= 0.8  # one node
    assert all(p.efficiency >= 0.7 and p.exposed_comm < 0.1 for p in points[2:])  # nodes


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="schedule"):
        Plan(schedule="looped")
    with pytest.raises(ValueError, match="sequence_parallel needs tp"):
        Plan(sequence_parallel=True)
    with pytest.raises(ValueError, match="unknown model"):
        shape("9b")
    with pytest.raises(ValueError, match="unknown hardware"):
        hardware("tpu")


def test_plan_command(capsys):
    assert main(["plan", "--model", "7b", "--devices", "16", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "7b (6.74B params" in out and out.count("tp") >= 3
    assert main(["plan", "--model", "medium", "--scaling", "1,2"]) == 0
    assert "weak scaling" in capsys.readouterr().out
